"""Multi-process (multi-host) start-up: JAX's multi-controller runtime, as CPD launched with srun.

Every process runs the same program; `initialize()` must be called once per process before any
other JAX call that touches devices. Afterwards `jax.devices()` lists the devices of all processes
(`jax.local_devices()` this process's), `jlp.train.data_mesh()` spans them all, and every process
feeds its own share of the batch (`jlp.train.shard_batch`).

How the process group is found (`jax.distributed.initialize`):
  * the cluster launcher (`python -m experiments.cluster`, `jlp.train.cluster`): `initialize()`
    with no arguments reads JLP_COORDINATOR, JLP_NUM_PROCESSES and JLP_PROCESS_ID, which the
    launcher exports to every host (`launched()` says whether they are set);
  * explicit: `initialize("host0:1234", num_processes=P, process_id=i)` on every process i
    (the coordinator, process 0, listens on host0:1234);
  * SLURM: `initialize()` with no arguments under `srun`: JAX reads SLURM_JOB_ID, SLURM_NTASKS
    (process count), SLURM_PROCID (process id), SLURM_LOCALID (which local GPU) and
    SLURM_STEP_NODELIST (the first node is the coordinator; port 61440 + SLURM_JOB_ID % 4096);
    other clusters JAX knows (Open MPI, Kubernetes JobSet, Cloud TPU) work the same way.
CPU devices talk through gloo (`jax_cpu_collectives_implementation`, set before initialize;
ignored by GPU/TPU backends, which use NCCL / ICI).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["initialize", "launched"]

CPU_COLLECTIVES = ("gloo", "mpi")


def launched() -> bool:
  """Whether this process is a host of the cluster launcher (its variables are set)."""
  return "JLP_COORDINATOR" in os.environ


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               *,
               local_device_ids: int | Sequence[int] | None = None,
               cpu_collectives: str = "gloo",
               initialization_timeout: int = 300,
               heartbeat_timeout: int | None = None) -> dict[str, int]:
  """Joins this process to the process group (see the module docstring); idempotent.

  Args:
    coordinator_address: "host:port" of process 0; None with the other two None: detect the
      cluster (SLURM under srun).
    num_processes: the number of processes (explicit mode).
    process_id: this process's index in 0..num_processes-1 (explicit mode).
    local_device_ids: the local devices this process uses (None: JAX's default / the cluster's).
    cpu_collectives: the CPU collectives implementation, "gloo" or "mpi".
    initialization_timeout: seconds to wait for every process to join.
    heartbeat_timeout: seconds without a heartbeat after which JAX's coordination service counts
      a process as dead and stops the others (jax's `heartbeat_timeout_seconds`); None: the
      launcher's --heartbeat_timeout (JLP_HEARTBEAT_TIMEOUT) under the launcher, else JAX's
      default (100).

  Returns:
    {"process_index", "process_count", "local_devices", "global_devices"}.
  """
  if coordinator_address is None and num_processes is None and process_id is None and \
      launched():
    coordinator_address = os.environ["JLP_COORDINATOR"]
    num_processes = int(os.environ["JLP_NUM_PROCESSES"])
    process_id = int(os.environ["JLP_PROCESS_ID"])
  explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes,
              "process_id": process_id}
  given = [k for k, v in explicit.items() if v is not None]
  if given and len(given) != 3:
    missing = next(k for k, v in explicit.items() if v is None)
    raise _invalid(missing, None, f"a value when {', '.join(given)} is given (all three, or none "
                   "to detect the cluster, e.g. SLURM)")
  if given:
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
      raise _invalid("coordinator_address", coordinator_address, "'host:port'")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
      raise _invalid("num_processes", num_processes, "an int >= 1")
    if (isinstance(process_id, bool) or not isinstance(process_id, int)
        or not 0 <= process_id < num_processes):
      raise _invalid("process_id", process_id, f"an int in [0, {num_processes})")
  if cpu_collectives not in CPU_COLLECTIVES:
    raise _invalid("cpu_collectives", cpu_collectives, f"one of {CPU_COLLECTIVES}")
  if not jax.distributed.is_initialized():
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    # Under the launcher the coordinator listens where the hosts reach it and nowhere else (JAX's
    # default is every interface: its coordination service has no authentication).
    bind = coordinator_address if launched() and process_id == 0 else None
    if heartbeat_timeout is None and os.environ.get("JLP_HEARTBEAT_TIMEOUT"):
      heartbeat_timeout = int(float(os.environ["JLP_HEARTBEAT_TIMEOUT"]))
    extra = {}
    if heartbeat_timeout is not None:
      if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, int) or \
          heartbeat_timeout < 1:
        raise _invalid("heartbeat_timeout", heartbeat_timeout, "an int >= 1 (seconds)")
      extra["heartbeat_timeout_seconds"] = heartbeat_timeout
    jax.distributed.initialize(coordinator_address,
                               num_processes,
                               process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout,
                               coordinator_bind_address=bind, **extra)
  return {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "local_devices": jax.local_device_count(),
      "global_devices": jax.device_count(),
  }
