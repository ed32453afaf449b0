"""RayExecutor: one Ray actor per rank (pipeline stage x tensor-parallel rank), on a local
or a multi-node cluster.

* Cluster: an existing one at `--ray-address` (e.g. `ray://head:10001` or `head:6379`),
  or, by default, a local one started here (bound to 127.0.0.1) and stopped at shutdown.
  A cluster that was already initialized in this process (tests share one per module) is
  used and left running.
* Placement: a placement group with one bundle per rank, `{"GPU": 1, "CPU": c}` when the
  cluster has GPUs, else `{"CPU": c}`. c is `--ray-cpus-per-worker`, by default
  min(1, cluster CPUs / ranks) rounded down to 0.01: fractional CPUs let tensor-parallel
  size 3 fit on a 2-core machine (the ranks then share the cores; each runs one torch
  thread). Bundles are packed (PACK), so ranks share a node when they can.
* Rendezvous: rank 0's actor reports its node's IP and a free port; every rank joins the
  torch.distributed group there (gloo on CPU, NCCL on GPUs).
* Steps: the encoded step message goes inline with each actor call when small (decode
  steps), else it is put in the object store once and every actor gets the same
  reference (measured with `python -m realexec bench pipeline --backend ray`: the put
  costs each step an extra fetch round trip, which idles the stages); the output rank (the last stage's TP driver) returns the sampled tokens,
  the others None. Pipeline stages hand hidden states to each other over the same
  torch.distributed group (point-to-point send/recv), not through Ray: no object-store
  round trip per step and stage, and the engine stays out of the activations' path.
* Order: with batches in flight several calls reach an actor before the first finishes,
  and a threaded actor does not promise to run them in submission order; every call
  carries a ticket (its submission number) and waits for its turn, so each rank applies
  the step messages (deltas) and enters the stage-to-stage transfers in the same order.
* Faults: a dead actor surfaces as RayActorError on its reference (named by rank); after
  `worker_timeout` without a result, the rank whose actor does not answer a liveness probe
  (served by a second actor thread) is named as hung; either way all actors are killed
  and the placement group removed.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from core.step_message import StepMessage
from realexec.config import EngineArgs
from realexec.executor.base import ExecutorBase, InOrderReplies, WorkerError, load_engine_tokenizer
from realexec.executor.serialization import decode_step, encode_step

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# Step messages up to this size are passed by value (decode steps: a few hundred bytes);
# a put object is fetched by each actor from the engine's store: one more round trip.
INLINE_MESSAGE_BYTES = 64 * 1024


class RayWorkerActor:
    """Wraps a Worker inside a Ray actor."""

    def __init__(self, args: EngineArgs, rank: int, world_size: int):
        import threading
        self.args, self.rank, self.world_size = args, rank, world_size
        self.worker = None
        self._turn = threading.Condition()
        self._next_ticket = 0

    def node_ip_and_port(self) -> tuple[str, int]:
        import ray
        from core.procs import free_port
        ip = ray.util.get_node_ip_address()
        return ip, free_port("127.0.0.1" if ip == "localhost" else ip)

    def start(self, init_method: str) -> int:
        from realexec.worker.worker import Worker
        self.worker = Worker(self.args, rank=self.rank, world_size=self.world_size, local_rank=0,
                             distributed_init_method=init_method, with_tokenizer=False)
        return os.getpid()

    def _in_turn(self, ticket: int, fn):
        """Run fn once every call with a smaller ticket has run."""
        with self._turn:
            self._turn.wait_for(lambda: self._next_ticket == ticket)
        try:
            return fn()
        finally:
            with self._turn:
                self._next_ticket += 1
                self._turn.notify_all()

    def execute(self, ticket: int, data: bytes):
        return self._in_turn(ticket, lambda: self.worker.execute_model(decode_step(data)))

    def alive(self) -> int:
        """Answered from a second actor thread even while a step runs (or waits in a
        collective); a stopped or wedged process does not answer."""
        return self.rank

    def rpc(self, ticket: int, method, args: tuple, kwargs: dict):
        from realexec.worker.worker import call_on_worker
        return self._in_turn(ticket, lambda: call_on_worker(self.worker, method, args, kwargs))


def default_cpus_per_worker(cluster_cpus: float, world_size: int) -> float:
    """At most one CPU per rank, and never more than the cluster has (so TP=3 fits on 2)."""
    return max(0.01, int(min(1.0, cluster_cpus / world_size) * 100) / 100)


def quiet_local_ray_auth() -> None:
    """Ray 2.60 turns token authentication on for every new local cluster and logs a
    warning that it did, unless RAY_AUTH_MODE is set: choose the same mode (token) explicitly.
    Ray reads the variable into its config when it is imported, so this only acts before
    that (set later, the driver would connect without its token); a user's own
    RAY_AUTH_MODE wins. Ray versions without token authentication ignore it."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


class RayExecutor(ExecutorBase):
    backend = "ray"

    def _init_workers(self) -> None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # before ray is imported
        if not self.args.ray_address:
            quiet_local_ray_auth()
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._ticket = 0
        self.actors, self.pg = [], None
        self._closed = False
        self._owns_ray = False
        if not ray.is_initialized():
            if self.args.ray_address:
                ray.init(address=self.args.ray_address, log_to_driver=False)
            else:
                ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": PROJECT_ROOT, "GLOO_SOCKET_IFNAME": "lo"}})
            self._owns_ray = True
        try:
            resources = ray.cluster_resources()
            n = self.world_size
            gpus = resources.get("GPU", 0) >= n
            cpus = self.args.ray_cpus_per_worker or default_cpus_per_worker(resources.get("CPU", 1), n)
            bundle = {"CPU": cpus, **({"GPU": 1} if gpus else {})}
            self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
            ready, _ = ray.wait([self.pg.ready()], timeout=self.args.worker_timeout)
            if not ready:
                raise RuntimeError(f"Ray placement group {n} x {bundle} not satisfiable within "
                                   f"{self.args.worker_timeout:g} s on a cluster with {resources}; "
                                   f"lower --ray-cpus-per-worker")
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [PROJECT_ROOT, os.environ.get("PYTHONPATH")])),
                   "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
            # Threads: the calls in flight (up to one step per stage, plus an RPC) waiting for
            # their turn, and `alive` beside them.
            cls = ray.remote(max_concurrency=self.layout.pp + 3)(RayWorkerActor)
            self.actors = [cls.options(num_cpus=cpus, num_gpus=1 if gpus else 0, runtime_env={"env_vars": env},
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           placement_group=self.pg, placement_group_bundle_index=rank),
                                       name=None, max_restarts=0).remote(self.args, rank, n)
                           for rank in range(n)]
            ip, port = self._get([self.actors[0].node_ip_and_port.remote()], "rendezvous")[0]
            self.pids = self._get([a.start.remote(f"tcp://{ip}:{port}") for a in self.actors], "start")
        except BaseException:
            self.shutdown()
            raise
        self._replies = InOrderReplies("twinserve-ray-replies")
        self._tokenizer = load_engine_tokenizer(self.args)

    @property
    def tokenizer(self):
        return self._tokenizer

    def _get(self, refs: list, what: str) -> list:
        """Results in order; a dead or hung actor fails the executor with its rank."""
        ray = self._ray
        if self.error is not None:
            raise self.error
        deadline = time.monotonic() + self.args.worker_timeout
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if not pending:
                try:
                    return ray.get(list(refs))       # the common case: one call, no per-rank look
                except Exception:                    # noqa: BLE001 - which rank, and how: below
                    pass
            failures = self._failures(refs, ready)
            if failures:
                if pending and not any(died for _, died, _ in failures):
                    # A peer's death makes the others' collectives fail: look for the dead one.
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=3.0)
                    failures += self._failures(refs, more)
                rank, died, e = sorted(failures, key=lambda f: (not f[1], f[0]))[0]
                cause = "its actor died" if died else "raised"
                raise self._fail(WorkerError(rank, f"{cause} during {what}: {type(e).__name__}: "
                                                   f"{str(e).strip().splitlines()[0][:300]}"))
            if pending and time.monotonic() > deadline:
                late = [refs.index(r) for r in pending]
                silent = self._unresponsive(min(5.0, self.args.worker_timeout))
                culprit = silent[0] if silent else late[0]
                raise self._fail(WorkerError(culprit, f"hung during {what}: no result within "
                                                      f"{self.args.worker_timeout:g} s (ranks without a result: {late}; "
                                                      f"not answering a liveness probe: {silent})"))
        return ray.get(list(refs))

    def _unresponsive(self, timeout: float = 5.0) -> list[int]:
        """Ranks whose actor does not answer `alive` within `timeout` seconds."""
        probes = [a.alive.remote() for a in self.actors]
        ready, _ = self._ray.wait(probes, num_returns=len(probes), timeout=timeout)
        return [rank for rank, p in enumerate(probes) if p not in ready]

    def _failures(self, refs: list, ready: list) -> list[tuple[int, bool, Exception]]:
        """(rank, died, error) of the ready references that failed."""
        ray = self._ray
        out = []
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:           # RayActorError (died), RayTaskError (raised)
                out.append((refs.index(ref), isinstance(e, ray.exceptions.RayActorError), e))
        return out

    def _next_ticket(self) -> int:
        ticket, self._ticket = self._ticket, self._ticket + 1
        return ticket

    def _send_rpc(self, method, args: tuple, kwargs: dict):
        ticket = self._next_ticket()
        refs = [a.rpc.remote(ticket, method, args, kwargs) for a in self.actors]
        return refs, getattr(method, "__name__", method), None

    def _send_step(self, msg: StepMessage):
        data = encode_step(msg)
        self.message_bytes += len(data)
        # A small message travels inline with each call (Ray copies arguments under its
        # inline limit into the task itself); a large one is put in the object store once.
        arg = data if len(data) <= INLINE_MESSAGE_BYTES else self._ray.put(data)
        ticket = self._next_ticket()
        return [a.execute.remote(ticket, arg) for a in self.actors], f"step {msg.step_id}", self.output_rank

    def _collect(self, handle):
        refs, what, rank = handle
        values = self._get(refs, what)
        return values if rank is None else values[rank]

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._close_replies()
        ray = self._ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            except Exception:
                pass
        if self._owns_ray:
            ray.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
