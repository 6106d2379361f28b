"""Two real JAX processes (jax.distributed on 127.0.0.1, gloo, 2 fake devices each) resuming from a step whose files
fail to read on one process only (a bad shard is read only by the hosts that hold it): the run stops with a line
naming the step, instead of each process falling back to another step by itself."""
import glob
import json
import os
import subprocess
import sys

import pytest

from tests.test_multiprocess import ROOT, env, free_port

WORKER = r"""
import json, sys
process, port, phase, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
import jax
import numpy as np
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process, heartbeat_timeout_seconds=10)
from jax.sharding import NamedSharding, PartitionSpec
from tupe_jax import checkpoint as ckpt
from tupe_jax.errors import UserError

mesh = jax.make_mesh((4,), ("rows",))
rows, whole = NamedSharding(mesh, PartitionSpec("rows")), NamedSharding(mesh, PartitionSpec())

def values(step):     # random, so that no shard is small enough to sit inline in OCDBT's index
    return np.random.default_rng(step).standard_normal((1024, 256)).astype(np.float32)

def state(step):
    return {"w": jax.make_array_from_callback((1024, 256), rows, lambda idx: values(step)[idx]),
            "step": jax.make_array_from_callback((), whole, lambda idx: np.int32(step))}

checkpointer = ckpt.Checkpointer(workdir, async_=False)
if phase == "save":
    checkpointer.save(1, state(1), {}, {}, force=True)
    checkpointer.save(2, state(2), {}, {}, force=True)
else:
    abstract = {"w": jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=rows),
                "step": jax.ShapeDtypeStruct((), np.int32, sharding=whole)}
    try:
        restored, _ = checkpointer.restore(None, abstract)
    except UserError as err:     # as the launcher prints it; then out at once (the others wait at a collective)
        print(err, file=sys.stderr, flush=True)
        import os
        os._exit(2)
    mine = sorted({step for s in restored["w"].addressable_shards for step in (1, 2)     # which step's rows it holds
                   if np.array_equal(np.asarray(s.data), values(step)[s.index])})
    print(json.dumps({"step": int(restored["step"]), "w": mine}), flush=True)
checkpointer.close()
"""


def both(phase, workdir, code=0):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port), phase, str(workdir)], cwd=ROOT,
                              env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if code == 0:
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
    return [p.returncode for p in procs], outs


@pytest.mark.slow
def test_a_step_that_fails_on_one_process_stops_the_run_with_its_line(tmp_path):
    """Each process fell back on its own: process 0 restored step 2 and process 1 step 1, into one global array
    (the loop then ran different step counts per host, on a state half of one step and half of another)."""
    both("save", tmp_path)
    assert [json.loads(out.strip().splitlines()[-1])["w"] for out, _ in both("resume", tmp_path)[1]] == [[2], [2]]
    data = glob.glob(str(tmp_path / "checkpoints" / "2" / "state" / "ocdbt.process_1" / "d" / "*"))
    assert data, os.listdir(tmp_path / "checkpoints" / "2" / "state")
    for path in data:                                  # process 1's shards of step 2 only: cut short
        os.truncate(path, 0)
    codes, outs = both("resume", tmp_path, code=None)
    assert codes[1] == 2 and codes[0] != 0, codes
    last = outs[1][1].strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint step 2 in {tmp_path / 'checkpoints'} failed to restore on process 1 ("
                           ) and last.endswith("several processes do not fall back to an earlier step by themselves")
    assert not any("{" in out for out, _ in outs) and sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
