"""`vlm-sdk bench-serve --red-team` at a small scale against an in-process server: every row of issue
28's table, then issue 41's, runs beside the victim stream and is reported; nothing is the server's fault."""
import json

from vlm_sdk.cli import main
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import MiB, ServerConfig


def test_red_team_quick(tiny_ckpt, capsys):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, max_request_bytes=64 * MiB), num_blocks=1200,
                          grammar_compile_timeout=3.0) as srv:
        code = main(["bench-serve", "--url", srv.url, "--red-team", "--red-team-scale", "0.01", "--json"])
    report = json.loads(capsys.readouterr().out)
    names = [r["name"].split()[0] for r in report["rows"]]
    assert names[:10] == [str(i) for i in range(1, 11)]
    assert {"41.1", "41.2", "41.4"} <= set(names)  # issue 41's video rows (bench/red_team_video.py)
    assert {"41.7", "41.9"} <= set(names)  # issue 41's tool rows (vlm_sdk/bench/red_team_tools.py)
    assert {"41.3", "41.5", "41.6", "41.8"} <= set(names)  # issue 41's load rows (vlm_sdk/bench/red_team_load.py)
    for row in report["rows"]:
        assert row["requests"] == sum(row["statuses"].values()) and row["worst_gap_s"] < float("inf")
        assert all(k == "200" or k.startswith("4") for k in row["statuses"]), row
        assert all(k == "200" for k in row["probe_statuses"]), row  # the probes are innocent requests
    assert report["server_errors"] == 0 and report["healthy_after"]
    assert set(report["targets_met"]) == {"crashes", "server_errors", "worst_gap_s", "rss_growth_bytes"}
    assert code == (0 if all(report["targets_met"].values()) else 1)
