"""The server process: bind a port, serve HTTP, publish the rendezvous file, withdraw it on exit."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping

import uvicorn

from ajet_hpc.config import ServerConfig, Topology
from ajet_hpc.config.placement import Placement, select_devices, visible_devices
from ajet_hpc.config.topology import co_trained, mix_of, repeats_feeding, server_placement
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.select import create_engine
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.server import deadline, preemption
from ajet_hpc.server.app import ServerContext, create_app
from ajet_hpc.server.recorder import EpisodeRecorder
from ajet_hpc.slurm import environment
from ajet_hpc.storage import rendezvous, task_ends
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator import Coordinator
from ajet_hpc.trainer.recovery import stored_summaries
from ajet_hpc.trainer.trackers import Trackers

log = logging.getLogger(__name__)

EXIT_FAILED = 3
"""Exit code of a server whose watchdog gave up (state ``failed``): its job ends FAILED, not requeued."""


def pick_server(topology: Topology, name: str | None) -> ServerConfig:
    if name is None:
        if len(topology.servers) != 1:
            names = ", ".join(s.name for s in topology.servers)
            raise SystemExit(f"this run has several servers ({names}): pass --name")
        return topology.servers[0]
    for server in topology.servers:
        if server.name == name:
            return server
    names = ", ".join(s.name for s in topology.servers)
    raise SystemExit(f"no server named {name!r} in this run; servers are: {names}")


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn, minus re-raising SIGTERM/SIGINT after shutdown: the server then withdraws its rendezvous
    and exits 0, where plain uvicorn would die of the re-raised signal before any cleanup."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._captured_signals:
            names = ", ".join(signal.Signals(sig).name for sig in self._captured_signals)
            log.info("stopped by %s", names)


class _Heartbeat(threading.Thread):
    """Publishes the rendezvous once uvicorn accepts connections, then refreshes it with the server's state
    and policy version. A write that fails (disk full, ESTALE on NFS, any error) is logged and retried
    every ``RETRY_S``; the thread never dies of it (a server without a heartbeat looks dead to clients)."""

    RETRY_S = 1.0
    LOG_EVERY_S = 60.0  # while writes keep failing, one warning per this many seconds

    def __init__(
        self, path, record: rendezvous.Rendezvous, server: uvicorn.Server, ctx: ServerContext
    ) -> None:
        super().__init__(name="rendezvous-heartbeat", daemon=True)
        self.path, self.record, self.server, self.ctx = path, record, server, ctx
        self.stopped = threading.Event()
        self.published = False
        self.failing_since: float | None = None  # monotonic time of the first of the failures in a row
        self._logged_at = 0.0

    def beat(self) -> None:
        current = dataclasses.replace(
            self.record,
            state=self.ctx.state,
            policy_version=self.ctx.engine.policy_version,
            step=self.ctx.step,
            last_step_at=self.ctx.last_step_at,
            reason=self.ctx.reason,
        )
        self.record = rendezvous.publish(self.path, current)

    def try_beat(self) -> bool:
        """``beat``, logging a failure instead of raising it; True if the rendezvous was written."""
        try:
            self.beat()
        except Exception as exc:
            now = time.monotonic()
            if self.failing_since is None:
                self.failing_since = now
            if now - self._logged_at >= self.LOG_EVERY_S:
                self._logged_at = now
                log.warning(
                    "cannot write the rendezvous %s (%s: %s), failing for %.0f s; retrying every %g s "
                    "(clients call a server stale after %g s without a heartbeat)",
                    self.path,
                    type(exc).__name__,
                    exc,
                    now - self.failing_since,
                    self.RETRY_S,
                    rendezvous.STALE_AFTER_S,
                )
            return False
        if self.failing_since is not None:
            log.warning(
                "rendezvous %s written again after %.0f s of failures",
                self.path,
                time.monotonic() - self.failing_since,
            )
            self.failing_since, self._logged_at = None, 0.0
        return True

    def run(self) -> None:
        while not self.server.started and not self.stopped.is_set():
            time.sleep(0.05)
        while not self.stopped.is_set():
            try:
                ok = self.try_beat()
                if ok and not self.published:
                    self.published = True
                    log.info("ready at %s (rendezvous %s)", self.record.url, self.path)
            except Exception:  # never seen; the thread must outlive anything
                log.exception("rendezvous heartbeat: unexpected error; going on")
                ok = False
            self.stopped.wait(rendezvous.HEARTBEAT_S if ok else min(self.RETRY_S, rendezvous.HEARTBEAT_S))

    def final_beat(self, tries: int = 5) -> None:
        """The last write (final state, after ``stop``): retried a few times, then given up, logged."""
        for attempt in range(tries):
            if self.try_beat():
                return
            if attempt < tries - 1:
                time.sleep(self.RETRY_S)
        log.error(
            "could not write the final state to the rendezvous %s; clients will see it go stale", self.path
        )

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


def _stop_when_idle(ctx: ServerContext, server: uvicorn.Server, grace_s: float = 60.0) -> None:
    """Once training is complete (or failed): let open episodes end (at most ``grace_s``), then stop
    serving."""

    def wait() -> None:
        deadline = time.monotonic() + grace_s
        while ctx.episodes.open_count and time.monotonic() < deadline:
            time.sleep(0.5)
        log.info("%s; stopping the server", "failed" if ctx.failed else "training complete")
        server.should_exit = True

    threading.Thread(target=wait, name="stop-when-idle", daemon=True).start()


def _sources_ended(run: RunDir, topology, server: str) -> str | None:
    """For the coordinator: a description once every client task feeding ``server`` has ended its work."""
    feeding = task_ends.feeding(run, topology, server)
    return feeding.describe() if feeding.all_ended else None


def _saving_on_sigterm(handle_exit):
    """uvicorn's exit handler, saving first on SIGTERM (``preemption.on_term``): uvicorn installs it for
    SIGTERM and SIGINT while it serves."""

    def handle(sig: int, frame) -> None:
        if sig == signal.SIGTERM:
            preemption.on_term()
        handle_exit(sig, frame)

    return handle


def _save_on_signal(ctx: ServerContext, budget_s: float) -> None:
    """The server's part of the save when its job goes down (see ``preemption``)."""
    started = time.monotonic()
    try:
        if ctx.coordinator is not None and not ctx.training_done:
            ctx.coordinator.save_on_signal(budget_s)
    finally:
        if ctx.recorder is not None and not ctx.recorder.flush(
            max(1.0, budget_s - (time.monotonic() - started))
        ):
            log.warning("signal: the episode store did not flush in time")


def is_server_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is the server of its allocation: the first task of the first node.

    A server job of several nodes runs one task per node (submitit, ``sbatch/server.sbatch``, hetjobs);
    only task 0 serves, the others leave the nodes to the trainer's ranks, which the server starts there."""
    return int(environ.get("SLURM_PROCID", "0")) == 0


def engine_settings(config: ServerConfig, placement: Placement) -> dict:
    """The engine's settings from the server's fields: the ``vllm`` block unless the engine is transformers
    (with ``engine: auto`` the engine picked drops what it lacks)."""
    vllm = config.vllm
    common = {"max_model_len": config.serving.max_model_len, "dtype": vllm.dtype}
    if config.engine == "transformers":
        return common
    return {
        **common,
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "max_num_seqs": vllm.max_num_seqs,
        "enable_prefix_caching": vllm.enable_prefix_caching,
        "enforce_eager": vllm.enforce_eager,
        "tensor_parallel_size": placement.tensor_parallel,
        "enable_sleep_mode": placement.mode == "colocate",
        "weight_transfer_backend": sync_backend(config, placement),
    }


def sync_backend(config: ServerConfig, placement: Placement) -> str | None:
    """vLLM's weight-transfer backend for ``trainer.weight_sync: memory``: NCCL from the trainer's GPUs to
    the engine's, CUDA IPC when they share the GPUs (colocate), our gloo backend on CPUs; None for disk."""
    if config.trainer is None or config.trainer.weight_sync != "memory":
        return None
    return {"cpu": "ajet_gloo", "split": "nccl", "colocate": "ipc"}[placement.mode]


def bind_engine_gpus(placement: Placement, environ: dict[str, str]) -> dict[str, str]:
    """Show the engine (this process and the vLLM workers it spawns) only its GPUs; returns the job step's
    environment as it was, for the trainer's ranks."""
    step_env = dict(environ)
    if placement.on_gpu:
        visible = visible_devices(step_env, placement.gpus_per_node)
        environ["CUDA_VISIBLE_DEVICES"] = select_devices(visible, placement.engine_gpus, "the engine")
    return step_env


def serve(run_dir: str | os.PathLike[str], name: str | None = None) -> int:
    setup_logging()
    run = RunDir.at(run_dir)
    topology = run.load_topology()
    config = pick_server(topology, name)
    job = environment.current()
    if not is_server_process():
        log.info(
            "server %s: task %s on node %s runs no server (the first task serves; trainer ranks reach this "
            "node through srun)",
            config.name,
            os.environ.get("SLURM_PROCID"),
            job.node,
        )
        return 0
    placement = server_placement(config)
    for line in placement.describe():
        log.info("placement: %s", line)
    step_env = bind_engine_gpus(placement, os.environ)  # type: ignore[arg-type]
    sock = _bind(job.bind_host(), config.port)
    host, port = job.advertise_host(), sock.getsockname()[1]
    log.info(
        "server %s (job %s) on node %s, listening on %s:%d", config.name, job.job_id, job.node, host, port
    )

    tls = config.serving  # TLS: the server speaks HTTPS and publishes an https URL (docs/security.md)
    scheme = "https" if tls.tls_certfile else "http"
    model_path = resolve_model(config.model, run.root / "models")
    engine = create_engine(config.engine, model_path, **engine_settings(config, placement))
    ctx = ServerContext(
        name=config.name,
        engine=engine,
        settings=config.serving,
        secret=run.read_secret(),
        job_id=job.job_id,
        public_url=f"{scheme}://{host}:{port}",
    )
    store = config.store  # group commit: episodes ending together share one fsync (docs/storage.md)
    ctx.attach_recorder(EpisodeRecorder.from_config(run.data_dir / f"{config.name}.h5", store))
    stored = stored_summaries(ctx.recorder.path)  # read once the writer holds the store's lease
    restored = ctx.episodes.restore_ended(stored)
    if restored:
        log.info("%d episode keys ended before this start (from %s)", restored, ctx.recorder.path)
    if config.trainer is not None:
        mix = mix_of(topology, config.name)
        coordinator = Coordinator(
            ctx, config, model_path, run.root, on_slurm=job.on_slurm, mix=mix, placement=placement
        )
        coordinator.rank_env = step_env
        coordinator.stored = stored
        if len(topology.run.trackers) > 1:  # beyond metrics.jsonl
            coordinator.trackers = Trackers(run.root, topology.run.name, config.name, topology.run.trackers)
        coordinator.collector.repeats_of = repeats_feeding(topology, config.name)
        coordinator.collector.ended_count = ctx.episodes.ended_count
        coordinator.sources_ended = lambda: _sources_ended(run, topology, config.name)
        ctx.attach_trainer(coordinator)
    server = GracefulServer(
        uvicorn.Config(
            create_app(ctx, freeze_heap=True),
            log_level="warning",
            access_log=False,
            ssl_certfile=tls.tls_certfile,
            ssl_keyfile=tls.tls_keyfile,
            timeout_keep_alive=math.ceil(config.serving.keep_alive_s),  # whole seconds for uvicorn
        )
    )
    record = rendezvous.Rendezvous(
        name=config.name,
        url=ctx.public_url,
        host=host,
        port=port,
        pid=os.getpid(),
        job_id=job.job_id,
        node=job.node,
        started_at=ctx.started_at,
    )
    partners = co_trained(topology, config.name)
    if partners:
        ctx.partners_done = lambda: all(
            (found := rendezvous.read(run.rendezvous_file(name))) is not None
            and found.state in ("trained", "finished")
            for name in partners
        )
    heartbeat = _Heartbeat(run.rendezvous_file(config.name), record, server, ctx)

    def on_finished() -> None:
        preemption.work_over("training is complete")
        heartbeat.try_beat()
        _stop_when_idle(ctx, server)

    def on_failed() -> None:
        preemption.work_over("the server failed")
        heartbeat.try_beat()
        _stop_when_idle(ctx, server, grace_s=5.0)

    ctx.on_finished, ctx.on_failed = on_finished, on_failed
    heartbeat.start()
    # the job going down (USR2, SIGTERM, the time limit near) saves once, then stops (``preemption``)
    cluster = topology.cluster
    preemption.configure(
        preemption.Budgets.of(cluster.signal_delay_s, cluster.kill_wait_s),
        job.job_id if job.on_slurm else None,
    )
    unregister = preemption.on_signal(lambda budget_s: _save_on_signal(ctx, budget_s))
    server.handle_exit = _saving_on_sigterm(server.handle_exit)  # type: ignore[method-assign]
    watch = None
    if job.on_slurm:
        watch = deadline.DeadlineWatch(
            cluster.signal_delay_s,
            end_time=lambda: deadline.job_end_time(job.job_id),
            fire=preemption.signal_deadline,
            ready=lambda: server.started,
            finished=lambda: ctx.training_done or ctx.failed or server.should_exit,  # done, or stopping
        )
        watch.start()
    try:
        server.run(sockets=[sock])
    finally:
        if watch is not None:
            watch.stop()
        unregister()
        heartbeat.stop()
        if ctx.failed or ctx.training_done:  # left in place, state final: clients stop instead of waiting
            heartbeat.final_beat()
            if ctx.failed:
                log.error("server %s failed: %s", config.name, ctx.reason)
            else:
                log.info("server %s finished its training (%s)", config.name, ctx.reason or "all steps")
        elif rendezvous.withdraw(run.rendezvous_file(config.name), heartbeat.record):
            log.info("rendezvous withdrawn; server %s stopped", config.name)
        sock.close()
    return EXIT_FAILED if ctx.failed else 0
