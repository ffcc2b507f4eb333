"""Two processes x 4 CPU devices (jax.distributed on localhost, gloo) give exactly the results of
one process with 8 devices: custom-precision all-reduces (float32 sequential, e4m3 ring + Kahan +
APS, e5m2 sequential + CPD APS) and two data-parallel train steps (small CNN, e4m3 APS gradient
sync, 2 emulated nodes per device, SGD with momentum and masked weight decay), and two with a
compressed sync (onebit with error feedback, CaSync-PS, per-device state sharded over processes).

Reference: the same code (`multiprocess_driver.all_cases`) run in this single 8-device process;
the comparison is bitwise.
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
