"""benchmarks/profile_step.py: matmul FLOPs read off the optimised HLO equal 2·M·K·F (plain and batched dots, dots
inside fusions), instructions are labelled by kind and place, trace events nested in another are counted once and
concurrent ones split the wall clock."""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from profile_step import busy_per_instruction, describe, parse_hlo, summarise, where  # noqa: E402  pylint: disable=wrong-import-position


def compiled_hlo(fn, *args) -> dict:
    return parse_hlo(jax.jit(fn).lower(*args).compile().as_text())


def matmul_flops(hlo: dict) -> int:
    return sum(describe(hlo, n)["flops"] for n in hlo["comps"][hlo["entry"]])


def test_plain_dot_flops():
    m, k, f = 48, 40, 24
    hlo = compiled_hlo(lambda a, b: a @ b, jnp.ones((m, k)), jnp.ones((k, f)))
    assert matmul_flops(hlo) == 2 * m * k * f


def test_batched_and_fused_dot_flops():
    b, h, q, d = 2, 3, 16, 8     # scores (b, h, q, q) then values: two batched dots, each 2·b·h·q·q·d
    def attention(x, y):
        s = jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", x, y) * 0.5)
        return jnp.einsum("bhqk,bkhd->bqhd", s, y) + 1.0
    hlo = compiled_hlo(attention, jnp.ones((b, q, h, d)), jnp.ones((b, q, h, d)))
    assert matmul_flops(hlo) == 2 * (2 * b * h * q * q * d)


def test_kinds_and_places():
    hlo = compiled_hlo(lambda a, b: (jnp.sum(a @ b, axis=1), jnp.exp(a).T), jnp.ones((32, 32)), jnp.ones((32, 32)))
    kinds = {describe(hlo, n)["kind"] for n in hlo["comps"][hlo["entry"]] if hlo["ops"][n][0] not in ("parameter",
                                                                                                   "tuple")}
    assert "matmul" in kinds and kinds <= {"matmul", "reduction", "elementwise", "layout"}
    assert where("jit(train_step)/transpose(jvp(TransformerLM))/encoder/blocks_3/mlp_in/dot_general") == \
        "backward encoder/blocks_*/mlp_in/dot_general"
    assert where("jit(train_step)/jvp(TransformerLM)/head_ln/mul") == "forward head_ln/mul"
    assert where("jit(train_step)/mul") == "outside the model (loss, clip, AdamW)"


def test_nested_events_count_once_and_other_threads_are_ignored():
    meta = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}}
            for t, n in ((1, "tf_XLAEigen/1"), (2, "tf_XLAEigen/2"), (3, "python"))]
    x = lambda tid, name, ts, dur: {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = [x(1, "while.1", 0, 1000), x(1, "add.2", 100, 200),          # add.2 runs inside the while
              x(1, "dot.3", 1000, 500), x(2, "dot.3", 1000, 500),         # two threads at once: both count
              x(1, "ThunkExecutor::Execute", 0, 5000), x(3, "dot.3", 0, 9000)]
    busy, share = busy_per_instruction({"traceEvents": meta + events}, steps=2)
    assert busy == {"while.1": 0.5, "dot.3": 0.5}
    # 0–1000 µs the while alone; 1000–1500 µs dot.3 on two threads: its wall share is that half millisecond once
    assert share == {"while.1": 0.5, "dot.3": 0.25}


def test_summary_rates():
    m, k, f = 64, 32, 16
    hlo = compiled_hlo(lambda a, b: a @ b, jnp.ones((m, k)), jnp.ones((k, f)))
    (dot,) = [n for n in hlo["comps"][hlo["entry"]] if describe(hlo, n)["kind"] == "matmul"]
    out = summarise(hlo, {dot: 2.0, "not-in-this-module": 5.0}, {dot: 1.0, "not-in-this-module": 3.0})
    assert out["busy_ms_per_step"] == 2.0 and out["covered_wall_ms_per_step"] == 1.0
    assert out["kinds"] == {"matmul": {"ms": 2.0, "wall_share_ms": 1.0}}
    (rate,) = out["matmuls"].values()
    assert abs(rate["gflops_per_s"] - 2 * m * k * f / 1e-3 / 1e9) < 1e-9   # over the 1 ms wall share


def test_a_matmul_event_far_shorter_than_its_work_is_dispatch_only():
    m, k, f = 64, 32, 16
    hlo = compiled_hlo(lambda a, b, c: (a @ b, c @ b.T), jnp.ones((m, k)), jnp.ones((k, f)), jnp.ones((m, f)))
    dots = [n for n in hlo["comps"][hlo["entry"]] if describe(hlo, n)["kind"] == "matmul"]
    assert len(dots) == 2
    flops = [describe(hlo, n)["flops"] for n in dots]
    # the first at a steady rate; the second's event 1/100 or 15/100 (launches: under a third of its work's time at
    # the two's average rate, here (1 + share) / 2 of the first's) or half (a fast matmul) of its time at that rate
    assert flops[0] == flops[1]
    for share, launched in ((0.01, True), (0.15, True), (0.5, False)):
        busy = {dots[0]: 1.0, dots[1]: share}
        out = summarise(hlo, busy, busy)
        flags = {r["instruction"]: r["dispatch_only"] for r in out["instructions"]}
        assert flags == {dots[0]: False, dots[1]: launched}, share
    busy = {dots[0]: 1.0, dots[1]: 0.01 * flops[1] / flops[0]}
    out = summarise(hlo, busy, busy)
    assert out["dispatch_only"]["instructions"] == 1 and out["dispatch_only"]["gflop"] == flops[1] / 1e9
    assert sum(p["gflop"] for p in out["matmuls"].values()) == flops[0] / 1e9


def test_a_while_body_does_its_flops_once_per_iteration():
    """The chunked loss is a while loop: its body's instructions are traced per iteration, the loop's own event
    holds none of their work."""
    n = 64
    hlo = compiled_hlo(lambda x, w: jax.lax.fori_loop(0, 8, lambda i, acc: jnp.tanh(acc @ w), x),
                       jnp.ones((n, n)), jnp.ones((n, n)))
    (body,) = hlo["runs"]
    assert hlo["runs"][body] == 8
    loops = [m for m in hlo["comps"][hlo["entry"]] if hlo["ops"][m][0] == "while"]
    assert loops and all(describe(hlo, m)["flops"] == 0 for m in loops)
    assert sum(describe(hlo, m)["flops"] for m in hlo["comps"][body]) == 8 * 2 * n ** 3
