"""`vlm-sdk bench-serve --soak` for a few seconds (issue 18, point 9): every kind of traffic happens,
nothing is the server's fault, no KV block is left, and the RSS figures are there."""
import json

from vlm_sdk.cli import main
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig


def test_soak_a_few_seconds(tiny_ckpt, capsys):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0), num_blocks=32) as srv:
        assert main(["bench-serve", "--url", srv.url, "--soak", "3", "--concurrency", "3", "--max-tokens", "6",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    o = report["outcomes"]
    assert o["completed"] > 0 and o["aborted"] > 0 and o["refused"] > 0, report
    assert o["server_error"] == o["lost"] == report["not_client_fault"] == 0, report["problems"]
    assert report["kv_blocks_used_end"] == 0 and report["running_end"] == 0
    assert report["rss_start_bytes"] > 0 and report["rss_samples"] >= 2  # sampled while it ran (about 1/s)
    assert report["rss_slope_bytes_per_1000_requests"] is not None
