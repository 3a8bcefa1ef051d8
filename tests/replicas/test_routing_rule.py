"""The cache-aware routing rule (vlm_sdk/replicas/routing.py) as plain functions, and the serve flags
without Ray installed. No Ray cluster here."""
import sys

import pytest

from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.replicas.routing import AffinityTable, Load, RoutingConfig, prompt_keys, rank_replicas
from vlm_sdk.server.cli import serve_main


def prompt(ids, image_key=None, salt=None) -> PromptInputs:
    images = [ImageInput(data=None, num_tokens=4, key=image_key)] if image_key is not None else []
    return PromptInputs(token_ids=list(ids), images=images, cache_salt=salt)


def test_a_later_turn_shares_the_keys_of_the_prefix_it_extends():
    turn1, turn2 = prompt(range(40)), prompt(list(range(40)) + [7] * 30)
    k1, k2 = prompt_keys(turn1, 16, 4096), prompt_keys(turn2, 16, 4096)
    assert len(k1) == 2 and len(k2) == 4  # whole chunks only, longest prefix first
    assert k2[-2:] == k1  # the first two chunks' hashes are turn 1's
    assert prompt_keys(prompt([1] + list(range(1, 40))), 16, 4096)[-1] != k1[-1]  # a different first chunk
    assert len(prompt_keys(turn2, 16, 32)) == 2  # only prefix_tokens are hashed


def test_the_first_image_key_comes_first_and_a_salt_changes_every_key():
    keyed = prompt_keys(prompt(range(20), image_key=b"img-a"), 16, 4096)
    assert keyed[0].startswith("image:") and len(keyed) == 2
    assert prompt_keys(prompt(range(20), image_key=b"img-b"), 16, 4096)[0] != keyed[0]
    salted = prompt_keys(prompt(range(20), image_key=b"img-a", salt="tenant"), 16, 4096)
    assert not set(salted) & set(keyed)


def test_the_owner_wins_unless_it_is_loaded_past_a_bound():
    config = RoutingConfig(max_queue=4, max_kv_usage=0.8)
    loads = {"a": Load(3, 0.5), "b": Load(0, 0.1), "c": Load(1, 0.0)}
    owned = {"a": 5, "b": 2, "c": 2}
    assert rank_replicas("a", loads, owned, config) == [["a"], ["b"], ["c"]]
    assert rank_replicas("a", {**loads, "a": Load(4, 0.5)}, owned, config)[0] == ["b"]  # queue bound
    assert rank_replicas("a", {**loads, "a": Load(0, 0.8)}, owned, config)[0] == ["b"]  # KV bound
    assert rank_replicas("a", {**loads, "a": Load(0, 0.1, reported=4)}, owned, config)[0] == ["b"]  # its report
    assert rank_replicas("gone", loads, owned, config)[0] == ["b"]  # an owner no longer among the replicas


def test_a_new_prefix_goes_to_the_fewest_in_flight_then_the_smallest_cache_share():
    config = RoutingConfig(max_queue=4, max_kv_usage=0.8)
    loads = {"a": Load(0, 0.0), "b": Load(0, 0.3), "c": Load(1, 0.2)}
    assert rank_replicas(None, loads, {"a": 6, "b": 1, "c": 0}, config) == [["b"], ["a"], ["c"]]
    assert rank_replicas(None, loads, {}, config) == [["a"], ["b"], ["c"]]  # equal shares: lowest KV usage
    past = {"a": Load(5, 0.0), "b": Load(3, 0.1), "c": Load(1, 0.9)}  # a and c past a bound: b first
    assert rank_replicas(None, past, {"b": 9}, config) == [["b"], ["c"], ["a"]]


def test_the_affinity_table_keeps_the_latest_owner_forgets_the_oldest_and_a_dead_replica():
    table = AffinityTable(capacity=3)
    table.record(["k1", "k2"], "a")
    assert table.owner(["x", "k2"]) == "a"
    table.record(["k2"], "b")
    assert table.owner(["k2"]) == "b" and table.owner(["k1"]) == "a"
    table.record(["k3", "k4"], "b")  # k1 was looked up after k2: k2 is the least recently used
    assert len(table) == 3 and table.owner(["k2"]) is None and table.owner(["k1"]) == "a"
    assert table.counts() == {"a": 1, "b": 2}
    table.forget("b")
    assert table.owner(["k3", "k4"]) is None and table.owner(["k1"]) == "a"


def test_routing_settings_are_checked():
    with pytest.raises(ValueError, match="least_loaded"):
        RoutingConfig(policy="least_loaded")
    with pytest.raises(ValueError, match="max_kv_usage"):
        RoutingConfig(max_kv_usage=1.5)


def test_data_parallel_size_without_ray_says_how_to_install_it(tiny_ckpt, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert serve_main([str(tiny_ckpt), "--port", "0", "--data-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'vlm-sdk[ray]'" in err and "--data-parallel-size" in err, err
