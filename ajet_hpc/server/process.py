"""The server process: bind a port, assemble the server (``server.assembly``), serve HTTP, publish the
rendezvous file, withdraw it on exit."""

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import uvicorn

from ajet_hpc.config import ServerConfig, ServingConfig, Topology
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.server import deadline, preemption
from ajet_hpc.server.app import create_app
from ajet_hpc.server.assembly import Job, assemble
from ajet_hpc.server.connections import (
    connection_bound,
    guarded_protocol,
    quiet_accept_errors,
    raise_descriptor_limit,
)
from ajet_hpc.server.context import ModelContext, ModelState
from ajet_hpc.slurm import environment
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.protocol.weight_handoff import remove_local_exports

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


LISTEN_BACKLOG = 65535
"""Connections the kernel may hold for the server to accept; it caps this at ``net.core.somaxconn`` (4096 on
Linux 5.4 and later). A full queue drops new handshakes (the kernel's ``TcpExtListenOverflows``), which the
client retries a second or more later: thousands of agents connecting at once overflowed the 2048 asked
for before (docs/scaling.md)."""


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
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


class Heartbeat(threading.Thread):
    """Publishes the rendezvous once uvicorn accepts connections, then refreshes it with the server's state
    and policy version. A write that fails (disk full, ESTALE on NFS, any error) is logged and retried
    every ``RETRY_S``; the thread never dies of it (a server without a heartbeat looks dead to clients)."""

    RETRY_S = 1.0
    LOG_EVERY_S = 60.0  # while writes keep failing, one warning per this many seconds

    def __init__(
        self, path, record: rendezvous.Rendezvous, server: uvicorn.Server, ctx: ModelContext
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


def _stop_when_idle(contexts: list[ModelContext], server: uvicorn.Server, grace_s: float = 60.0) -> None:
    """Once training is complete (or failed): let open episodes end (at most ``grace_s``), then stop
    serving."""

    def wait() -> None:
        deadline = time.monotonic() + grace_s
        while any(ctx.episodes.open_count for ctx in contexts) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {ctx.name: ctx.episodes.open_count for ctx in contexts if ctx.episodes.open_count}
        if left:
            log.warning("episodes still open after %g s, not waited for: %s", grace_s, left)
        failed = any(ctx.failed for ctx in contexts)
        log.info("%s; stopping the server", "failed" if failed else "training complete")
        server.should_exit = True

    threading.Thread(target=wait, name="stop-when-idle", daemon=True).start()


def _saving_on_sigterm(handle_exit):
    """uvicorn's exit handler, saving first on SIGTERM (``preemption.on_term``): uvicorn installs it for
    SIGTERM and SIGINT while it serves."""

    def handle(sig: int, frame) -> None:
        if sig == signal.SIGTERM:
            preemption.on_term()
        handle_exit(sig, frame)

    return handle


def _save_on_signal(contexts: list[ModelContext], budget_s: float) -> None:
    """The server's part of the save when its job goes down (see ``preemption``): every model's trainer
    is asked to save at once (their ranks save in parallel), then every store flushes."""
    started = time.monotonic()
    try:
        training = [
            c.coordinator
            for c in contexts
            if c.coordinator is not None and c.state is not ModelState.FINISHED
        ]
        if len(training) == 1:
            training[0].save_on_signal(budget_s)
        elif training:
            savers = [
                threading.Thread(target=coordinator.save_on_signal, args=(budget_s,), name="save-on-signal")
                for coordinator in training
            ]
            for saver in savers:
                saver.start()
            for saver in savers:
                saver.join()
    finally:
        for ctx in contexts:
            left = max(1.0, budget_s - (time.monotonic() - started))
            if not ctx.recorder.flush(left):
                log.warning("signal: the episode store of %s did not flush in time", ctx.name)


def is_server_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is the server of its allocation: the first task of the first node.

    A server job of several nodes runs one task per node (submitit, ``sbatch/server.sbatch``, hetjobs);
    only task 0 serves, the others leave the nodes to the trainer's ranks, which the server starts there."""
    return int(environ.get("SLURM_PROCID", "0")) == 0


class Beside(Protocol):
    """A process started beside the server, ended when the server stops serving (``subprocess.Popen``)."""

    def terminate(self) -> None: ...


StartBeside = Callable[[RunDir, Topology, str], Beside | None]
"""What the launch layer hands down to start beside the server (the keeper of its client arrays,
``launch/keeper_start.py``): called with the run, its topology and the server's name in the process that
serves, once the server is assembled, right before it serves; None when there is nothing to start. What it
returns is terminated first when serving ends, however it ends."""


def serve(run_dir: str | os.PathLike[str], name: str | None = None, beside: StartBeside | None = None) -> int:
    """Serve the server ``name`` of the run: bind, assemble (`assembly.assemble`), serve until training is
    over or the job goes down, then tear down; the process's exit code. ``beside`` (the launch layer's
    keeper) starts a process beside the server, see ``StartBeside``."""
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
    sock = _bind(job.bind_host(), config.port)
    host, port = job.advertise_host(), sock.getsockname()[1]
    log.info(
        "server %s (job %s) on node %s, listening on %s:%d", config.name, job.job_id, job.node, host, port
    )
    scheme = "https" if config.serving.tls_certfile else "http"  # TLS: docs/security.md
    where = Job(job, public_url=f"{scheme}://{host}:{port}")
    _, contexts = assemble(run, topology, config, where)  # several models: each under /m/<name>
    server = uvicorn_server(create_app(contexts, freeze_heap=True), config)
    heartbeats = []
    for ctx in contexts:
        record = rendezvous.Rendezvous(
            name=ctx.name,
            url=ctx.public_url,
            host=host,
            port=port,
            pid=os.getpid(),
            job_id=job.job_id,
            node=job.node,
            started_at=ctx.job.started_at,
        )
        heartbeats.append(Heartbeat(run.rendezvous_file(ctx.name), record, server, ctx))
    _stop_when_over(contexts, server, heartbeats)
    for heartbeat in heartbeats:
        heartbeat.start()
    # the job going down (USR2, SIGTERM, the time limit near) saves once, then stops (``preemption``)
    cluster = topology.cluster
    preemption.configure(
        preemption.Budgets.of(cluster.signal_delay_s, cluster.kill_wait_s),
        job.job_id if job.on_slurm else None,
    )
    unregister = preemption.on_signal(lambda budget_s: _save_on_signal(contexts, budget_s))
    server.handle_exit = _saving_on_sigterm(server.handle_exit)  # type: ignore[method-assign]
    watch = _watch_deadline(job, cluster.signal_delay_s, server, contexts)
    companion = beside(run, topology, config.name) if beside is not None else None
    try:
        server.run(sockets=[sock])
    finally:
        if companion is not None:
            companion.terminate()
        if watch is not None:
            watch.stop()
        unregister()
        for ctx, heartbeat in zip(contexts, heartbeats, strict=True):
            heartbeat.stop()
            _leave(ctx, run.rendezvous_file(ctx.name), heartbeat)
            if ctx.coordinator is not None:  # its weight exports on this node's disk: nobody reads them now
                remove_local_exports(ctx.coordinator.work_dir)
        sock.close()
    return EXIT_FAILED if any(ctx.failed for ctx in contexts) else 0


def uvicorn_server(app: Any, config: ServerConfig) -> GracefulServer:
    return GracefulServer(uvicorn_config(app, config.serving))


def uvicorn_config(app: Any, serving: ServingConfig) -> uvicorn.Config:
    """uvicorn's settings for a server: its keep-alive, TLS, and the guarded protocol (request deadlines,
    a bound on open connections below the open-file limit, which is raised to its hard limit here)."""
    bound = connection_bound(serving.max_connections, raise_descriptor_limit())
    quiet_accept_errors()
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        ssl_certfile=serving.tls_certfile,
        ssl_keyfile=serving.tls_keyfile,
        timeout_keep_alive=math.ceil(serving.keep_alive_s),  # whole seconds for uvicorn
        http=guarded_protocol(serving.header_timeout_s, serving.body_timeout_s, bound),
    )


def _stop_when_over(
    contexts: list[ModelContext], server: uvicorn.Server, heartbeats: list[Heartbeat]
) -> None:
    """Once a model's training is complete, or it failed: say so in its rendezvous; once every trained
    model of the server is over, stop serving (a model that only serves finishes with them)."""

    trained = [ctx for ctx in contexts if ctx.coordinator is not None] or contexts

    def on_over(heartbeat: Heartbeat, grace_s: float) -> None:
        heartbeat.try_beat()
        if not all(ctx.over for ctx in trained):
            return
        for ctx, other in zip(contexts, heartbeats, strict=True):
            if not ctx.over:  # a model that only serves beside the trained ones
                ctx.finish_serving("the models trained beside it are done")
                other.try_beat()
        failed = any(ctx.failed for ctx in contexts)
        preemption.work_over("the server failed" if failed else "training is complete")
        _stop_when_idle(contexts, server, grace_s)

    for ctx, heartbeat in zip(contexts, heartbeats, strict=True):
        ctx.on_finished = lambda heartbeat=heartbeat: on_over(heartbeat, 60.0)
        ctx.on_failed = lambda heartbeat=heartbeat: on_over(heartbeat, 5.0)


def _watch_deadline(
    job: environment.JobEnvironment,
    signal_delay_s: float,
    server: uvicorn.Server,
    contexts: list[ModelContext],
) -> deadline.DeadlineWatch | None:
    """On Slurm: save and stop ``signal_delay_s`` before the job's time limit, should Slurm's own signal
    not come (``deadline``)."""
    if not job.on_slurm:
        return None
    watch = deadline.DeadlineWatch(
        signal_delay_s,
        end_time=lambda: deadline.job_end_time(job.job_id),
        fire=preemption.signal_deadline,
        ready=lambda: server.started,
        finished=lambda: all(c.over for c in contexts) or server.should_exit,
    )
    watch.start()
    return watch


def _leave(ctx: ModelContext, rendezvous_file: Path, heartbeat: Heartbeat) -> None:
    """A server whose work is over leaves its rendezvous in place, state final (clients then stop instead
    of waiting); a server stopped before that (the job going down, to be requeued) withdraws it."""
    if ctx.over:
        heartbeat.final_beat()
        if ctx.failed:
            log.error("server %s failed: %s", ctx.name, ctx.reason)
        else:
            log.info("server %s finished its training (%s)", ctx.name, ctx.reason or "all steps")
    elif rendezvous.withdraw(rendezvous_file, heartbeat.record):
        log.info("rendezvous withdrawn; server %s stopped", ctx.name)
