"""Issue 41's video rows over HTTP, each beside an innocent stream whose worst gap between two lines
stays under 0.5 s (on a loaded machine: under the bound server_helpers.stall_bound measures from the same
stream's quiet window), on a server with serve's video and image defaults:

    row 1   two 16000x16000 PNG frames in a 63 KB MOV: a 400 from the header (max_image_pixels), at once
    row 2   hundreds of thousands of tiny frames with nframes 2: a 400 from the MP4 header's frame count
            (max_video_container_frames), from the index where the header states none (Matroska), and
            from the decode budget, each tiny frame counted as 256x256, for frames reached from one keyframe
    row 4   clients hanging up while their videos are indexed and decoded: the work stops, and the next
            video request is answered about as fast as on an idle server
    row 9   video settings of 10**400 (nframes, fps, min_frames, total_pixels): a 400 naming the field
    row 10  a 100,000-frame video (4,000 s) refused for its length from its header, at once
"""
from __future__ import annotations

import json
import socket
import time

import pytest

from server_helpers import API_KEY, VictimStream, assert_no_stall, post, post_bytes, wait_for
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import MediaPolicy, ServerConfig
from vlm_sdk.testing.hostile_videos import many_frames, png_mov
from vlm_sdk.testing.videos import write_video

# wall-clock bounds: ./run test runs these alone, after the rest (see the README)
pytestmark = pytest.mark.timing

OPTS = {"fps": 2.0, "min_pixels": 4 * 28 * 28, "max_pixels": 8 * 28 * 28}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_media")
    files = {"clip.mp4": write_video(frames=24, fps=8, width=96, height=64),
             "huge_frames.mov": png_mov(16000),
             "frames_300k.mp4": many_frames(300_000, fps=1000),
             "frames_250k.mkv": many_frames(250_000, fps=1000, container="matroska"),
             "one_key_130k.mp4": many_frames(130_000, fps=1000, keyframes=False),
             "one_key_120k.mkv": many_frames(120_000, fps=1000, container="matroska", keyframes=False),
             "frames_100k_25fps.mp4": many_frames(100_000, fps=25)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


@pytest.fixture(scope="module")
def srv(tiny_ckpt, media):
    config = ServerConfig(port=0, api_key=API_KEY, media=MediaPolicy(allowed_local_path=str(media)))
    with BackgroundServer(tiny_ckpt, config, num_blocks=800) as s:
        yield s


def _body(srv, url: str, max_tokens: int = 2, **options) -> dict:
    return {"model": srv.model_name, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url, **options}}, {"type": "text", "text": "What happens?"}]}]}


def _beside_victim(srv, attack):
    """(the victim's worst gap while `attack()` runs, its pace over as long a quiet window after, its
    result, its seconds)."""
    with VictimStream(srv.url, srv.model_name) as victim:
        t0 = time.monotonic()
        result = attack()
        t1 = time.monotonic()
        gap = victim.worst_gap(t0, t1)
        quiet = victim.quiet_gap(t1 - t0)
    assert victim.statuses and set(victim.statuses) == {200}
    return gap, quiet, result, t1 - t0


def _refused(srv, media, name: str, **options) -> tuple[dict, float, float]:
    gap, quiet, (status, body), seconds = _beside_victim(
        srv, lambda: post(srv.url, _body(srv, (media / name).as_uri(), **options), timeout=120))
    assert status == 400, body
    print(f"{name} {options}: 400 in {seconds:.2f} s, victim's worst gap {gap:.3f} s (quiet: {quiet}): "
          f"{body['error']['message'][:160]}")
    assert_no_stall(gap, quiet, f"while {name} was refused")
    return body["error"], seconds, gap


def test_row1_huge_frames_are_refused_from_the_header(srv, media):
    err, seconds, _ = _refused(srv, media, "huge_frames.mov")
    assert err["code"] == "invalid_video" and err["param"] == "messages"
    assert "its frames are 16000x16000 = 256,000,000 pixels (from its header), over the limit of 16,777,216 pixels " \
           "per frame (setting max_image_pixels, flag --max-image-pixels" in err["message"]
    assert seconds < 1.0


@pytest.mark.parametrize("name, words", [
    ("frames_300k.mp4", "has 300,000 frames (from its header), over the limit of 216,000 frames per video (setting "
                        "max_video_container_frames, flag --max-video-container-frames"),
    ("frames_250k.mkv", "has more than 216,000 frames, over the limit of 216,000 frames per video (setting "
                        "max_video_container_frames"),
    ("one_key_130k.mp4", "would need 130,000 frames decoded = 8,519,680,000 pixels (each frame counted as at least "
                         "65,536 pixels: decoding a frame has a fixed cost)"),
])
def test_row2_a_great_many_tiny_frames_are_refused_before_they_are_decoded(srv, media, name, words):
    err, seconds, _ = _refused(srv, media, name, nframes=2)
    assert err["code"] == "invalid_video" and words in err["message"], err["message"]
    if "from its header" in words:
        assert seconds < 1.0  # before a packet is indexed


def _send_and_hang_up(url: str, body: dict) -> socket.socket:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.sendall(post_bytes(json.dumps(body).encode()))
    return conn


def test_row4_hanging_up_stops_the_video_work(srv, media):
    """Two clients send videos that keep a preprocessing thread busy for seconds each (120,000 frames
    indexed, then decoded from one keyframe) and hang up after 0.5 s. A small video sent then is
    answered within a second of its time on an idle server: the hostile work stopped."""
    clip = _body(srv, (media / "clip.mp4").as_uri(), **OPTS)

    def timed():
        t0 = time.monotonic()
        status, body = post(srv.url, clip, timeout=120)
        assert status == 200, body
        return time.monotonic() - t0
    idle = min(timed() for _ in range(2))

    def attack():
        conns = [_send_and_hang_up(srv.url, _body(srv, (media / name).as_uri(), nframes=2))
                 for name in ("one_key_120k.mkv", "one_key_120k.mkv")]
        time.sleep(0.5)
        for conn in conns:
            conn.close()  # the clients leave: the server cancels their handlers
        return timed()
    gap, quiet, after, _ = _beside_victim(srv, attack)
    print(f"row 4: the next video answered in {after:.2f} s (idle: {idle:.2f} s); victim's worst gap {gap:.3f} s "
          f"(quiet: {quiet})")
    assert after < idle + 1.0
    assert_no_stall(gap, quiet, "while two hung-up videos were being preprocessed")
    # nothing left behind once the victim's own last stream is aborted too
    assert wait_for(lambda: srv.stats()["num_running"] == srv.stats()["num_waiting"] == 0, timeout=10)


@pytest.mark.parametrize("field", ["nframes", "fps", "min_frames", "total_pixels"])
def test_row9_huge_video_settings_are_a_400_naming_the_field(srv, media, field):
    options = {field: 10 ** 400, **({} if field in ("nframes", "fps") else {"fps": 2.0})}
    err, _, _ = _refused(srv, media, "clip.mp4", **options)
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert f"{field} must be" in err["message"] and "an integer of 401 digits" in err["message"]


def test_row10_a_length_refusal_comes_from_the_header(srv, media):
    err, seconds, _ = _refused(srv, media, "frames_100k_25fps.mp4")
    assert "lasts 4000.0 s, over the limit of 3600 s (setting max_video_seconds, flag --max-video-seconds" \
           in err["message"]
    assert seconds < 0.5
