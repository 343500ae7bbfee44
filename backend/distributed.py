"""Tensor parallelism over processes (nano-vllm's shape): rank 0 schedules, workers mirror it.

Rank 0 is the engine's own process; ranks 1..tp-1 are spawned worker processes, one per device
(cuda:base+r on CUDA, all on the CPU otherwise). Each step rank 0 sends every worker a small
picklable plan over a pipe (per sequence: state slot, block table, the token ids the step reads,
num_computed, num_new); every rank runs the same forward on its shard, collectives meet inside
it (NCCL on CUDA with NVLink multicast off, gloo on the CPU), and rank 0 gathers the logits and
samples. Workers never sample and keep no scheduler state.

Weights: rank 0 slices the checkpoint (`shard_state_dict`) and hands each worker its shard as one
flat buffer in shared memory (one file descriptor per worker, whatever the tensor count). The
host lookup tables (token embedding, Engram tables, a layer's tables back to back) are moved to
shared memory once and mapped by every rank: one copy in host memory for all ranks; on CUDA
each rank locks them in place (`engram.pin`) so that its GPU reads them as in one-GPU runs.

Decode: every rank captures the same CUDA graphs (their collectives included) and replays them
when rank 0's plan is a decode batch. Multi-token decode steps (`run_decode_steps`) feed the
sampled token on the device: rank 0 samples and broadcasts it, every rank shifts it in.

Failures: a worker that raises reports its traceback to rank 0 and exits; before each step rank
0 checks that every worker lives, and a collective with a dead peer fails (gloo notices the
closed socket at once; on NCCL a watcher thread aborts the communicators when a worker exits,
and the process-group timeout bounds a hung one). Either way the step raises `WorkerError`
naming the rank and cause; the engine then fails its requests, and the runner stays failed.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from volundr.block_manager import grown_from
from volundr.config import VolundrConfig
from volundr.model.parallel import ALL_REDUCE_PATHS, check_tp, shard_state_dict
from volundr.model.weights import host_tensor_names
from volundr.model_runner import ModelRunner
from volundr.scheduler import ScheduledSeq

TIMEOUT_S = float(os.environ.get("VOLUNDR_TP_TIMEOUT_S", "300"))  # a collective, or start-up


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or raised; the engine cannot continue."""


# ---- the per-step plan ----------------------------------------------------------------------
class _Window:
    """The slice of a sequence's token ids that a step reads, indexed by absolute position."""

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        assert s.start >= self.start, "the plan carries too short a token window"
        return self.ids[s.start - self.start:s.stop - self.start]


@dataclass
class _SeqView:
    """What ModelRunner.prepare/run read of a Sequence."""
    slot: int
    block_table: list[int]
    num_computed_tokens: int
    num_tokens: int
    token_ids: _Window
    input_embeds: dict  # position -> [hidden] vector, only those this step reads
    resume: object = None  # volundr.session.Resume: this rank's parked shard to restore


def make_plan(batch: list[ScheduledSeq], max_order: int,
              sent: dict[int, tuple[list[int], int]]) -> list[tuple]:
    """What the workers need of a step. Block tables go as (from, entries): what each grew
    since the plan before (a long table is not resent every step); from 0: the whole table, a
    new one (block_manager.grown_from, TableMirror's rule too). sent[slot] = (the table sent,
    its length), updated."""
    plan = []
    for item in batch:
        seq, s = item.seq, item.seq.num_computed_tokens
        start = max(0, s - max_order + 1)  # the Engram n-grams reach max_order - 1 back
        e = s + item.num_new_tokens
        embeds = {p: v for p, v in seq.input_embeds.items() if s <= p < e}
        t = seq.block_table
        n = grown_from(*sent.get(seq.slot, (None, 0)), t)
        sent[seq.slot] = (t, len(t))
        plan.append((seq.slot, (n, t[n:]), seq.num_computed_tokens, seq.num_tokens,
                     start, seq.token_ids[start:e], item.num_new_tokens, embeds, seq.resume))
    return plan


def batch_from_plan(plan: list[tuple], tables: dict[int, list[int]]) -> list[ScheduledSeq]:
    """A worker's batch of a plan; tables[slot]: its copy of each slot's block table, grown or
    replaced as the plan says (make_plan)."""
    out = []
    for slot, (n, grown), done, total, start, ids, new, embeds, resume in plan:
        if n == 0:
            tables[slot] = list(grown)
        else:
            assert len(tables[slot]) == n, "a block table out of step with rank 0's"
            tables[slot] += grown
        out.append(ScheduledSeq(_SeqView(slot, tables[slot], done, total, _Window(start, ids),
                                         embeds, resume), new))
    return out


# ---- weights in shared memory ---------------------------------------------------------------
def share_host_tables(cfg: VolundrConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The host tables in shared memory, once for all ranks; each Engram layer's J tables lie
    back to back in one buffer (the layout of its GPU lookup, `engram.pinned_tables`)."""
    out: dict[str, torch.Tensor] = {}
    for i in cfg.engram.layers:
        names = [f"model.layers.{i}.engram.tables.{j}" for j in range(cfg.engram.num_tables)]
        buf = torch.cat([sd[n].to("cpu") for n in names]).share_memory_()
        out.update(zip(names, buf.split([sd[n].shape[0] for n in names])))
    for n in host_tensor_names(cfg):
        if n not in out:
            out[n] = sd[n].to("cpu").contiguous().share_memory_()
    return out


def pack(sd: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """One flat uint8 buffer (64-byte aligned entries) + its index [(name, dtype, shape, off)]."""
    index, off = [], 0
    for name, t in sd.items():
        index.append((name, t.dtype, tuple(t.shape), off))
        off += -(-t.numel() * t.element_size() // 64) * 64
    buf = torch.empty(max(off, 1), dtype=torch.uint8)
    for (_, dtype, shape, o), t in zip(index, sd.values()):
        n = t.numel() * t.element_size()
        buf[o:o + n].view(dtype).view(shape).copy_(t)
    return buf, index


def unpack(buf: torch.Tensor, index: list[tuple]) -> dict[str, torch.Tensor]:
    return {name: buf[o:o + _nbytes(dtype, shape)].view(dtype).view(shape)
            for name, dtype, shape, o in index}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for x in shape:
        n *= x
    return n


# ---- the worker process ---------------------------------------------------------------------
def _device(base: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", (base.index or 0) + rank) if base.type == "cuda" else base


def _worker_main(rank: int, tp: int, port: int, cfg: VolundrConfig, runner_kw: dict,
                 index: list, conn) -> None:
    device = _device(runner_kw.pop("device"), rank)
    try:
        # The tensors come over the pipe, not as arguments: the Process object would keep its
        # arguments (this rank's weight buffer) alive for the life of the worker.
        host, buf = conn.recv()
        if device.type == "cpu":  # ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        else:
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, tp, is_master=False, timeout=timeout)
        conn.send(("hello", rank))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=rank, world_size=tp, timeout=timeout)
        runner = ModelRunner(cfg, {**host, **unpack(buf, index)}, device, tp_rank=rank,
                             tp_size=tp, **runner_kw)
        del host, buf
        conn.send(("ready", rank))
        graphs, tables = runner.graphs, {}  # (tables: each slot's block table, make_plan)
        while (msg := conn.recv()) is not None:
            if msg[0] == "graphs":  # rank 0 switched decode to eager or back (benchmarks)
                runner.graphs = graphs if msg[1] else None
                continue
            if msg[0] == "session":  # snap / unsnap / park / forget, as rank 0 does
                getattr(runner, msg[1])(*msg[2])
                continue
            _, plan, steps, stop_ids = msg
            batch = batch_from_plan(plan, tables)
            if steps == 1:
                runner.run(batch)
            else:
                runner.run_decode_steps(batch, steps, stop_ids)
    except EOFError:  # rank 0 went away
        os._exit(0)
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        finally:
            os._exit(1)  # no teardown: a collective may be stuck waiting for us
    if graphs is not None:
        graphs.release()  # before the process group: its teardown waits for them
    dist.destroy_process_group()


# ---- rank 0 ---------------------------------------------------------------------------------
class TensorParallelRunner:
    """ModelRunner's interface (`run`, `model`, `states`, `prepare`) over `tp` ranks."""

    def __init__(self, cfg: VolundrConfig, state_dict: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, num_slots: int, num_blocks: int,
                 block_size: int, seed: int = 0, max_model_len: int = 2048, tp: int = 2,
                 gpu_budget_gib: float | None = None, cuda_graphs: bool = True,
                 kv_dtype: torch.dtype | None = None):
        check_tp(cfg, tp)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: "
                               "one tensor-parallel engine per process")
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + tp:
            raise ValueError(f"--tp {tp} needs {tp} GPUs from {device}; "
                             f"{torch.cuda.device_count()} visible")
        for var, off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                         ("NVSHMEM_DISABLE_NVLS", "1")):  # NVLink multicast off, as inherited
            os.environ.setdefault(var, off)  # by the workers
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback only
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # raise, don't kill us
        self.tp, self.failed = tp, None
        self.max_order = cfg.engram.max_order
        self._sent: dict[int, tuple[list[int], int]] = {}  # make_plan's block tables sent
        # VOLUNDR_TP_ALLREDUCE=symm: decode-sized all-reduces through symmetric memory
        # (parallel.enable_one_shot; prepared, not yet run on GPUs), else NCCL
        all_reduce = os.environ.get("VOLUNDR_TP_ALLREDUCE", "nccl")
        if all_reduce not in ALL_REDUCE_PATHS:
            raise ValueError(f"VOLUNDR_TP_ALLREDUCE must be one of {ALL_REDUCE_PATHS}, not "
                             f"{all_reduce!r}")
        runner_kw = dict(dtype=dtype, num_slots=num_slots, num_blocks=num_blocks,
                         block_size=block_size, seed=seed, max_model_len=max_model_len,
                         gpu_budget_gib=gpu_budget_gib, cuda_graphs=cuda_graphs,
                         tp_all_reduce=all_reduce, kv_dtype=kv_dtype)
        host = share_host_tables(cfg, state_dict)
        compute = {n: t for n, t in state_dict.items() if n not in host}
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        ctx = mp.get_context("spawn")
        if "python" not in os.path.basename(sys.executable or ""):
            # Embedded interpreters (Triton's Python backend stub) report their host binary.
            ctx.set_executable(os.path.join(sys.exec_prefix, "bin", "python3"))
        self.procs, self.conns = [], []
        self._graphs: list = []  # rank 0's CUDAGraphRunner, released before the group
        threads = torch.get_num_threads()
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, threads,
                                           self._graphs)
        atexit.register(self._finalizer)  # before the multiprocessing atexit kills the workers
        try:
            for r in range(1, tp):
                buf, index = pack({n: t.to("cpu") for n, t in shard_state_dict(
                    cfg, compute, r, tp).items()})
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, name=f"volundr-tp{r}", daemon=True,
                                args=(r, tp, store.port, cfg, dict(runner_kw, device=device),
                                      index, child))
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
                parent.send((host, buf.share_memory_()))  # file descriptors: a small message
                del buf
            if device.type == "cpu":  # the ranks share the cores; idle OpenMP threads spin
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
            self._wait_all("hello")
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                    rank=0, world_size=tp, timeout=timeout)
            self.runner = ModelRunner(cfg, {**host, **shard_state_dict(cfg, compute, 0, tp)},
                                      device, tp_rank=0, tp_size=tp, **runner_kw)
            if self.runner.graphs is not None:
                self._graphs.append(self.runner.graphs)
            self._wait_all("ready")
        except BaseException:
            self.close()
            raise
        self.model, self.states, self.prepare = self.runner.model, self.runner.states, \
            self.runner.prepare
        if device.type == "cuda":
            threading.Thread(target=_watch, args=(self.procs, self._finalizer), daemon=True,
                             name="volundr-tp-watch").start()

    # ---- supervision ----------------------------------------------------------------------
    def _wait_all(self, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        for p, c in zip(self.procs, self.conns):
            while not c.poll(0.05):
                if not p.is_alive() or time.monotonic() > deadline:
                    raise self._fail(f"while starting ({what})")
            try:
                msg = c.recv()
            except (EOFError, OSError):
                raise self._fail(f"while starting ({what})") from None
            if msg[0] != what:
                raise self._fail(f"while starting ({what})", msg)

    def _fail(self, when: str, msg: tuple | None = None) -> WorkerError:
        """Marks the runner failed, stops the workers; the error names rank and cause."""
        if self.failed is None:
            causes = []
            for r, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
                m = msg if msg is not None and msg[1] == r else None
                p.join(0.5 if m is None else 0)  # let a dying worker report / be reaped
                try:
                    if m is None and c.poll(0):
                        m = c.recv()
                except (EOFError, OSError):
                    pass
                if m is not None and m[0] == "error":
                    causes.append(f"worker rank {r} raised:\n{m[2]}")
                elif not p.is_alive():
                    causes.append(f"worker rank {r} (pid {p.pid}) exited with code "
                                  f"{p.exitcode}")
            self.failed = (f"tensor-parallel engine failed {when}: "
                           + ("; ".join(causes) or "a collective failed or timed out"))
            self.close()
        return WorkerError(self.failed)

    def check(self) -> None:
        """Raises WorkerError if the runner failed or a worker is gone."""
        if self.failed is not None:
            raise WorkerError(self.failed)
        for p, c in zip(self.procs, self.conns):
            if not p.is_alive() or c.poll(0):
                raise self._fail("before a step")

    # ---- the step -------------------------------------------------------------------------
    def run(self, batch: list[ScheduledSeq]) -> list[int]:
        return self._step(batch, 1)

    def run_decode_steps(self, batch: list[ScheduledSeq], steps: int,
                         stop_ids: list[tuple[int, ...]] | None = None) -> list[list[int]]:
        return self._step(batch, steps, stop_ids)

    def _step(self, batch: list[ScheduledSeq], steps: int, stop_ids=None):
        self.check()
        msg = ("run", make_plan(batch, self.max_order, self._sent), steps, stop_ids)
        try:
            for c in self.conns:
                c.send(msg)
            if steps == 1:
                return self.runner.run(batch)
            return self.runner.run_decode_steps(batch, steps, stop_ids)
        except Exception as e:
            raise self._fail("during a step") from e

    # ---- sessions: every rank copies its own shard (ModelRunner's methods of these names) ---
    def _session(self, op: str, *args, frees: bool = False):
        """op on every rank. Freeing ops (unsnap, forget) are best effort: once the runner has
        failed (its requests being aborted) or a worker is gone, only rank 0 frees its copy."""
        if self.failed is None:
            try:
                for c in self.conns:
                    c.send(("session", op, args))
            except OSError as e:
                if not frees:
                    raise self._fail(f"in a session {op}") from e
        return getattr(self.runner, op)(*args)

    def snap(self, key: int, slot: int) -> None:
        self._session("snap", key, slot)

    def unsnap(self, key: int) -> None:
        self._session("unsnap", key, frees=True)

    def park(self, ticket: int, slot: int, blocks: list[int], snap_key: int | None) -> int:
        """Rank 0's host bytes (each rank parks its shard)."""
        return self._session("park", ticket, slot, blocks, snap_key)

    def forget(self, ticket: int) -> None:
        self._session("forget", ticket, frees=True)

    def session_nbytes(self, num_blocks: int, prompt_state: bool = False) -> int:
        return self.runner.session_nbytes(num_blocks, prompt_state)

    @property
    def graphs(self):
        """Rank 0's CUDAGraphRunner (None: decode runs eagerly)."""
        return self.runner.graphs

    @graphs.setter
    def graphs(self, g) -> None:
        """Benchmarks switch decode to eager (None) and back (the value read before); every
        rank follows, so that the collectives stay in step."""
        self.runner.graphs = g
        for c in self.conns:
            c.send(("graphs", g is not None))

    def close(self) -> None:
        self._finalizer()


def _watch(procs: list, finalizer: weakref.finalize) -> None:
    """NCCL cannot see a dead peer: when a worker exits while the runner is open, abort the
    communicators so that a pending collective fails instead of hanging until the timeout."""
    from multiprocessing.connection import wait

    wait([p.sentinel for p in procs])
    if finalizer.alive and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()


def _shutdown(procs: list, conns: list, threads: int, graphs: list) -> None:
    for c in conns:
        try:
            c.send(None)
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    for c in conns:
        c.close()
    for g in graphs:  # (whoever still holds them: the graphs are destroyed, not just dropped)
        try:
            g.release()
        except Exception:  # after a failure the device may report it here: teardown goes on
            pass
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group aborted after a failure: nothing left to release
            pass
    torch.set_num_threads(threads)
