"""Two processes x 4 CPU devices (jax.distributed on localhost, gloo) give exactly the results of
one process with 8 devices: custom-precision all-reduces (float32 sequential, e4m3 ring + Kahan +
APS, e5m2 sequential + CPD APS) and two data-parallel train steps (small CNN, e4m3 APS gradient
sync, 2 emulated nodes per device, SGD with momentum and masked weight decay), and three with a
compressed sync (onebit with error feedback, CaSync-PS, per-device state sharded over processes),
where the two processes checkpoint the state (orbax, both writing their devices' rows of the
compression state) after step two, restore it into a fresh state and take the third step from it;
and compressed syncs run directly (`jlp.compression.sync_with_bytes`, two calls with the state
carried): CaSync-Ring with onebit and with stochastic TernGrad (keyed), CaSync-PS with DGC (keyed,
sparse), each with a SeCoPa plan of K = 3 < W partitions for one leaf: sums, every device's new
state and the wire bytes.

Reference: the same code (`multiprocess_driver.all_cases`) run in this single 8-device process;
the comparison is bitwise, the leaves the syncs send uncompressed included (CaSync sums them with
a ring all-reduce of a fixed order; `lax.psum`'s float32 order differs between the two layouts).
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import multiprocess_driver as driver  # noqa: E402

TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_processes(out_dir, num_processes=2):
  import jax  # pylint: disable=g-import-not-at-top
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // num_processes}"
  env["JAX_PLATFORMS"] = "cpu"
  # The processes compile the same programs at once: no shared persistent cache (conftest.py).
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  # The same compiler settings as this process (the fast_compile fixture), so the same programs.
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = str(jax.config.read("jax_disable_most_optimizations"))
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
  port = _free_port()
  procs = [
      subprocess.Popen([sys.executable, driver.__file__, str(i), str(num_processes), str(port),
                        str(out_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
      for i in range(num_processes)
  ]
  return procs


def _results(procs, out_dir):
  """Waits for the processes (killing them all on a timeout or failure); their npz results."""
  logs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=TIMEOUT_S)
      logs.append(out.decode(errors="replace"))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n" + logs[i][-4000:]
  return [dict(np.load(os.path.join(out_dir, f"process_{i}.npz"))) for i in range(len(procs))]


@pytest.mark.parametrize("kwargs, field", [
    (dict(coordinator_address="127.0.0.1:1234"), "num_processes"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2), "process_id"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), "coordinator_address"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2), "process_id"),
    (dict(cpu_collectives="nccl"), "cpu_collectives"),
])
def test_initialize_rejects_bad_arguments_before_starting(kwargs, field):
  import jax  # pylint: disable=g-import-not-at-top
  import jlp.train  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=f"^{field}="):
    jlp.train.initialize(**kwargs)
  assert not jax.distributed.is_initialized()


# Slow tier: as root (CI), tests/train/cluster_test.py runs the same comparison on namespaced hosts
# in the default tier.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile")
def test_two_processes_equal_one_process(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == driver.GLOBAL_DEVICES
  results = _results(_start_processes(tmp_path), tmp_path)
  expected = driver.all_cases()
  assert any(k.startswith("allreduce/") for k in expected)
  assert any(k.startswith("train/state") for k in expected)
  assert any(k.startswith("compressed/params") for k in expected)
  for i, got in enumerate(results):
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
      np.testing.assert_array_equal(got[key], want, err_msg=f"process {i}: {key}")
  # The steps did something: the loss changed, and not to NaN.
  losses = [float(expected[f"train/loss{i}"]) for i in range(driver.STEPS)]
  assert all(np.isfinite(losses)) and losses[0] != losses[-1]
  # The two processes resumed from a checkpoint holding non-zero residuals, every device's own.
  assert os.path.isdir(tmp_path / "ckpt" / "checkpoints" / str(driver.STEPS))
  residuals = [v for k, v in expected.items() if k.startswith("resumed/sync_state")]
  assert residuals and all(r.shape[0] == driver.GLOBAL_DEVICES for r in residuals)
  rows = np.concatenate([r.reshape(driver.GLOBAL_DEVICES, -1) for r in residuals], axis=1)
  assert np.all(np.any(rows != 0, axis=1)) and len({r.tobytes() for r in rows}) == 8
  _check_compressed_syncs(expected)


def _check_compressed_syncs(expected):
  """The direct compressed syncs are not trivial: lossy sums of the compressed leaves, the others
  exact; states that differ per device and change from call to call (where the compressor has
  state), a planned leaf in 3 slots."""
  calls = driver.sync_data()
  for name, (codec, _, _, plan) in driver.SYNC_CASES.items():
    compressed = [leaf for leaf in driver.SYNC_SHAPES if leaf not in driver.psum_leaves(name)]
    assert "a" in compressed and "c" not in compressed
    for i, grads in enumerate(calls):
      prefix = f"sync/{name}/{i}/"
      for leaf, g in grads.items():
        got = expected[f"{prefix}sum['{leaf}']"]
        if leaf not in compressed:  # the float32 ring all-reduce
          np.testing.assert_allclose(got, np.sum(g, axis=0), rtol=1e-6, atol=1e-5,
                                     err_msg=f"{prefix}{leaf}")
          continue
        exact = np.sum(g.astype(np.float64), axis=0)
        assert np.any(got != exact.astype(np.float32)), (prefix, leaf)
        if i == 0:  # the first call's sum is an approximation of the exact one
          assert np.corrcoef(got.ravel(), exact.ravel())[0, 1] > 0.5, (prefix, leaf)
      assert float(expected[prefix + "wire_bytes"]) > 0
      states = {k: v for k, v in expected.items() if k.startswith(prefix + "state")}
      if codec == "terngrad":  # no state
        assert not states
        continue
      # One entry per compressed leaf at least (onebit's residual, DGC's u and v), each with a
      # row per device and a slot per partition.
      assert {("a" if "['a']" in k else "b") for k in states} == set(compressed), sorted(states)
      for k, v in states.items():
        leaf = "a" if "['a']" in k else "b"
        assert v.shape[:2] == (driver.GLOBAL_DEVICES, plan.get(f"['{leaf}']", (True, 8))[1]), k
      rows = np.concatenate([v.reshape(driver.GLOBAL_DEVICES, -1) for v in states.values()], 1)
      assert len({r.tobytes() for r in rows}) == driver.GLOBAL_DEVICES, prefix
      if i:
        before = [expected[k.replace(prefix, f"sync/{name}/0/")] for k in states]
        assert any(np.any(v != b) for v, b in zip(states.values(), before)), prefix
