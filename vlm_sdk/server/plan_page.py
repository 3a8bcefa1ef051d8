"""GET /plan: the running engine's plan as a page (plan/picture.py: the memory bar, requests at once by
context length) with its live usage refreshing in place, and GET /plan/live, the numbers it polls.

    /plan        the start-up memory report drawn as `vlm-sdk plan --html` draws a plan, plus a live bar of
                 the KV blocks (used, cached-free, free), the state slots and the queue; a script fetches
                 /plan/live every half second and changes the bar's widths and the numbers in place
    /plan/live   {"kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free", "state_slots_used",
                 "state_slots_free", "num_running", "num_waiting", "prefix_cache_hit_tokens",
                 "prefix_cache_query_tokens"} from the engine's stats

Open like /metrics (no API key: a browser opens it; it shows sizes and counts, no request's content). An
engine without a start-up report (data-parallel replicas) answers 404 naming why.
"""
from __future__ import annotations

from aiohttp import web

from vlm_sdk.plan.picture import at_once_curve, group_blocks_for, page
from vlm_sdk.server.protocol import APIError

LIVE_WIDTH = 900
_SCRIPT = """<script>
(() => {
  const W = %d, bar = document.getElementById("live-bar");
  const set = (id, v) => { document.getElementById(id).textContent = String(v); };
  async function refresh() {
    try {
      const r = await fetch("/plan/live", {cache: "no-store"});
      if (!r.ok) return;
      const s = await r.json();
      const total = Math.max(s.kv_blocks_total, 1);
      const used = s.kv_blocks_used, cached = s.kv_blocks_cached, free = s.kv_blocks_free - s.kv_blocks_cached;
      let x = 0;
      for (const [id, n] of [["live-used", used], ["live-cached", cached], ["live-free", free]]) {
        const rect = document.getElementById(id), w = n / total * W;
        rect.setAttribute("x", x); rect.setAttribute("width", w); rect.dataset.blocks = n; x += w;
      }
      set("live-used-n", used); set("live-cached-n", cached); set("live-free-n", s.kv_blocks_free);
      set("live-running", s.num_running); set("live-waiting", s.num_waiting);
      set("live-slots", s.state_slots_used === null ? "none (no state layers)" :
          s.state_slots_used + " used, " + s.state_slots_free + " free");
      bar.dataset.updated = String(Number(bar.dataset.updated || 0) + 1);
    } catch (e) { /* the server went away: keep the last numbers */ }
  }
  refresh();
  setInterval(refresh, 500);
})();
</script>""" % LIVE_WIDTH


def live_numbers(stats: dict) -> dict:
    state = [g for g in stats.get("cache_groups") or () if g.get("kind") == "state"]
    return {"kv_blocks_total": stats["kv_blocks_total"], "kv_blocks_used": stats["kv_blocks_used"],
            "kv_blocks_cached": stats["kv_blocks_cached"], "kv_blocks_free": stats["kv_blocks_free"],
            "state_slots_used": state[0]["slots_used"] if state else None,
            "state_slots_free": state[0]["slots_free"] if state else None,
            "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
            "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
            "prefix_cache_query_tokens": stats["prefix_cache_query_tokens"]}


_LIVE = ('<h2>Live: KV blocks and queue</h2><svg id="live-bar" xmlns="http://www.w3.org/2000/svg" width="{w}" '
         'height="30" data-updated="0"><rect id="live-used" x="0" y="0" width="0" height="30" fill="#e15759"/>'
         '<rect id="live-cached" x="0" y="0" width="0" height="30" fill="#f1ce63"/><rect id="live-free" x="0" y="0" '
         'width="{w}" height="30" fill="#a0cbe8"/></svg><p>blocks used <b id="live-used-n">-</b>, cached-free '
         '<b id="live-cached-n">-</b>, free <b id="live-free-n">-</b> (of {total:,}); state slots <b id="live-slots">-'
         '</b>; running <b id="live-running">-</b>, waiting <b id="live-waiting">-</b></p>')


class PlanPage:
    """`server`: the `OpenAIServer` whose engine it draws."""

    def __init__(self, server):
        self.server = server

    async def page(self, request: web.Request) -> web.Response:
        engine = self.server.engine
        report = getattr(engine, "memory_report", None)
        if report is None:
            raise APIError(404, "this engine has no start-up memory report to draw (data-parallel replicas: open "
                                "each replica's own); `vlm-sdk plan --html` draws the plan offline", code="not_found")
        args, stats = engine.args, engine.stats()
        d = report.to_dict() | {"max_num_seqs": args.max_num_seqs, "longest_request_tokens": stats["max_model_len"],
                                "architecture": self.server.model_name}
        slots = d["num_state_slots"] or args.max_num_seqs
        curve = at_once_curve(min(args.max_num_seqs, slots), d["num_blocks"],
                              group_blocks_for(d["cache_groups"], d["block_size"], args.max_num_batched_tokens),
                              stats["max_model_len"])
        live = _LIVE.format(w=LIVE_WIDTH, total=stats["kv_blocks_total"])
        body = page(d, curve, f"{self.server.model_name}: the running engine", extra=live, script=_SCRIPT)
        return web.Response(text=body, content_type="text/html")

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response(live_numbers(self.server.engine.stats()))
