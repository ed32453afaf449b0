"""Break each invariant the core claims, once, and check that a test goes red.

    python -m tests.mutation_sweep                 # every mutant against tests/core
    python -m tests.mutation_sweep --only pool     # the mutants whose name contains "pool"
    python -m tests.mutation_sweep --list
    python -m tests.mutation_sweep --tests tests/core/kv -- --hypothesis-seed=0

Each mutant is one textual edit (an exact snippet and its replacement) of a core file.
They run one at a time in a scratch copy of the checkout (its tracked and untracked,
non-ignored files), never in the checkout itself: a sweep that is interrupted leaves
nothing broken behind. A mutant is *killed* when pytest fails (or runs past
--timeout: a hang; or past --memory-gib), *survived* when the tests pass, *stale* when its snippet no longer
occurs exactly once (update the list with the code), *known* when it survives for the
reason its entry states. The exit status is 1 if any mutant survived or went stale.

Some mutants are not behaviour changes a user would see (a double free that goes
unreported, a decode span skipped in smaller pieces); they are here because the code
claims the check, and a claim no test exercises rots.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    # Why the tests cannot see it (an equivalent mutant, or a case no test has built yet):
    # a known survivor is reported but does not fail the sweep; one that gets killed is news.
    known_survivor: str = ""


POOL, KV, SCHED = "core/kv/block_pool.py", "core/kv/kv_cache_manager.py", "core/sched/scheduler.py"

MUTANTS = [
    # -- the block pool ---------------------------------------------------------------------
    Mutant("pool: a fresh pool hands ids out of order", POOL,
           "out = free[-take:][::-1] if take else []", "out = free[-take:] if take else []"),
    Mutant("pool: an evicted block gets no reference", POOL,
           "        for b in out:\n            ref[b] = 1", "        for b in out[:take]:\n            ref[b] = 1"),
    Mutant("pool: a freed cached block skips the evictor", POOL,
           "                if hashes[b] is not None:\n                    cache(b)",
           "                if False:\n                    cache(b)"),
    Mutant("pool: double free unreported (no cache)", POOL, "                elif r < 0:", "                elif r < -1:"),
    Mutant("pool: double free unreported (cache)", POOL,
           "            if r < 0:\n                raise RuntimeError", "            if r < -1:\n                raise RuntimeError"),
    Mutant("pool: a hit block stays evictable", POOL,
           "        if self.ref_cnt[block_id] == 0:\n            self.evictor.remove(block_id)",
           "        if False:\n            self.evictor.remove(block_id)"),
    Mutant("pool: hits not told to the evictor", POOL,
           "        self.evictor.touch(block_id)              # type: ignore[union-attr]\n", "        pass\n"),
    Mutant("pool: a second publisher overwrites the index", POOL,
           "if self.evictor is None or block_hash in self.cached:", "if self.evictor is None:"),
    Mutant("pool: eviction keeps the evictor's memory of the block", POOL,
           "            self.evictor.forget(block_id)         # type: ignore[union-attr]\n", "            pass\n"),
    Mutant("pool: eviction keeps the index entry", POOL,
           "            if self.cached.get(h) == block_id:\n                del self.cached[h]",
           "            if False:\n                del self.cached[h]"),
    Mutant("pool: reset_cache loses the blocks", POOL,
           "            self._drop_hash(b)\n            self._free.append(b)\n            n += 1",
           "            self._drop_hash(b)\n            n += 1"),
    Mutant("pool: evictions not counted", POOL, "            self.num_evictions += 1\n", ""),
    # -- the block manager ----------------------------------------------------------------
    Mutant("kv: a prefix hit covers the last token", KV,
           "max_blocks = (seq.num_tokens - 1) // self.block_size", "max_blocks = seq.num_tokens // self.block_size"),
    Mutant("kv: block hashes ignore the salt", KV, "salt if i == 0 else None)", "None)"),
    Mutant("kv: capacity check forgets copy-on-write", KV,
           "            need += 1                                   # copy-on-write",
           "            need += 0                                   # copy-on-write"),
    Mutant("kv: reviving cached blocks is free", KV,
           "revived = sum(1 for b in cached if self.gpu.ref_cnt[b] == 0) if cached else 0", "revived = 0"),
    Mutant("kv: copy-on-write only past two holders", KV,
           "cow = computed % bs != 0 and gpu.ref_cnt[table[-1]] > 1",
           "cow = computed % bs != 0 and gpu.ref_cnt[table[-1]] > 2"),
    Mutant("kv: copy-on-write keeps the source reference", KV, "            gpu.free((src,))\n", ""),
    Mutant("kv: copy-on-write copy not queued", KV, "            self.pending_copies.append((src, dst))\n", ""),
    Mutant("kv: a block is published before its tokens are known", KV,
           "full = min(end, len(seq.token_ids)) // bs", "full = end // bs"),
    Mutant("kv: fork takes no references", KV, "        self.gpu.incref(table)\n", ""),
    Mutant("kv: free releases head first", KV,
           "            self.gpu.free(reversed(table))", "            self.gpu.free(table)"),
    Mutant("kv: free keeps the swapped table", KV,
           "        cpu_table = self.cpu_tables.pop(seq.seq_id, None)",
           "        cpu_table = self.cpu_tables.get(seq.seq_id, None)"),
    Mutant("kv: the watermark off by one", KV,
           "return self.gpu.num_free - num_blocks >= self.watermark_blocks",
           "return self.gpu.num_free - num_blocks > self.watermark_blocks"),
    Mutant("kv: admission ignores the watermark", KV,
           "return self._leaves_watermark(need) if keep_watermark else self.gpu.num_free >= need\n\n    def _leaves",
           "return self.gpu.num_free >= need\n\n    def _leaves"),
    Mutant("kv: a swapped-in table is never published again", KV,
           "                self._num_registered[s.seq_id] = 0", "                pass"),
    Mutant("kv: swapping splits shared blocks", KV,
           "                if d is None:\n                    d = mapping[b] = dst_pool.allocate(1)[0]\n"
           "                else:\n                    dst_pool.incref((d,))",
           "                d = mapping[b] = dst_pool.allocate(1)[0]"),
    Mutant("kv: swap-out space counts shared blocks twice", KV,
           "        return self._distinct_blocks([self.tables.get(s.seq_id, ()) for s in seqs]) <= self.cpu.num_free",
           "        return sum(len(self.tables.get(s.seq_id, ())) for s in seqs) <= self.cpu.num_free"),
    Mutant("kv: a retracted slice stays published", KV,
           "            self.gpu._drop_hash(b)       # (a block", "            pass       # (a block"),
    Mutant("kv: the decode fast path fills a block", KV,
           "if offset and offset != self._last_offset:", "if offset:"),
    Mutant("kv: the decode fast path writes a shared block", KV,
           "            if self._gpu_ref_cnt[table[-1]] == 1:\n                return table", "            return table"),
    Mutant("kv: decode spans end one step early", KV, "            if growth(mid) <= free:", "            if growth(mid) < free:"),
    Mutant("kv: skipped decodes publish a step late", KV,
           "events[(-c - 1) % bs].append((seq, False))", "events[(-c) % bs].append((seq, False))"),
    Mutant("kv: claiming a prefix takes no references", KV,
           "        for b in cached:\n            self.gpu.hit(b)\n        self.tables", "        self.tables"),
    Mutant("kv: no decode span ever copies on write", KV,
           "return any(s.num_computed_tokens % bs and ref[tables[s.seq_id][-1]] > 1 for s in seqs)", "return False"),
    # -- the scheduler --------------------------------------------------------------------
    Mutant("sched: fast-path decodes take no budget", SCHED,
           "                        decodes += 1\n                        budget -= 1\n",
           "                        decodes += 1\n"),
    Mutant("sched: admission ignores max_num_seqs", SCHED,
           "            if len(out.scheduled) + len(request.seqs) > seats:\n                break\n            admission",
           "            if False:\n                break\n            admission"),
    Mutant("sched: swap-in ignores max_num_seqs", SCHED,
           "            if len(out.scheduled) + len(request.seqs) > seats:\n                break\n"
           "            if not kv.can_swap_in",
           "            if False:\n                break\n            if not kv.can_swap_in",
           known_survivor="with one batch in flight running + swapped sequences never exceed max_num_seqs, "
                          "so only pipeline parallelism with swap preemption can reach it; the pipelined "
                          "machine checks each batch's size but has not drawn that case"),
    Mutant("sched: a step that preempts still admits", SCHED,
           "        if not preempted:\n            budget = self._swap_in", "        if True:\n            budget = self._swap_in"),
    Mutant("sched: waiting requests pass swapped ones", SCHED,
           "            if not self.swapped:\n                self._admit(budget, out, now)",
           "            if True:\n                self._admit(budget, out, now)"),
    Mutant("sched: long prefills uncapped", SCHED,
           "            n = min(n, cfg.long_prefill_token_threshold)", "            n = n"),
    Mutant("sched: chunks without chunked prefill", SCHED,
           "        if n < pending and not cfg.enable_chunked_prefill:\n            return 0",
           "        if False:\n            return 0"),
    Mutant("sched: beams leave lock-step", SCHED, "            n = min(pending - 1, budget)", "            n = min(pending, budget)"),
    Mutant("sched: a partial prefill samples", SCHED,
           "            if end >= len(seq.token_ids):       # (one past", "            if True:       # (one past"),
    Mutant("sched: prefill tokens not counted", SCHED,
           "            if n > 1:\n                out.num_prefill_tokens += n\n        out.num_batched",
           "        out.num_batched"),
    Mutant("sched: an unscheduled slice stays published", SCHED,
           "                if retract is not None:\n                    retract(s.seq)",
           "                if False:\n                    retract(s.seq)",
           known_survivor="the victim's blocks are released tail first, so the allocation that preempted it "
                          "evicts the taken-back slice's block at once under LRU: no scenario tried (a grid of "
                          "pool sizes, prompts, budgets and arrivals, with a later twin prompt) left it indexed; "
                          "KVCacheManager.retract itself is tested in tests/core/sched/test_vllm_v1.py"),
    Mutant("sched: recompute keeps the computed count", SCHED,
           "            self.kv.free(seq)\n            seq.num_computed_tokens = 0", "            self.kv.free(seq)"),
    Mutant("sched: recompute keeps the sequence slots", SCHED,
           "        self._seq_slots -= request.params.num_seqs_max\n        request.metrics._queued_since = now",
           "        request.metrics._queued_since = now"),
    Mutant("sched: a preempted request queues at the tail", SCHED,
           "        self.waiting.add_preempted(request)", "        self.waiting.add(request)"),
    Mutant("sched: the victim may be an already scheduled request", SCHED,
           "                    victim = self.policies.victim.select(running[i:])",
           "                    victim = self.policies.victim.select(running)"),
    Mutant("sched: one sequence slot too many", SCHED,
           "        if self._seq_slots + request.params.num_seqs_max > self._slot_limit:",
           "        if self._seq_slots + request.params.num_seqs_max > self._slot_limit + 1:"),
    Mutant("sched: an idle engine keeps the watermark", SCHED,
           "        idle = not self.running and not self.swapped", "        idle = False"),
    Mutant("sched: vllm-v1 admission reserves only the chunk", SCHED, "        if self._reserve_full:", "        if False:"),
    Mutant("sched: a group's prefix hits claimed late", SCHED,
           "            for seq, _ in plan:\n                kv.claim_prefix(seq, hits[seq.seq_id])\n", ""),
    Mutant("sched: a fork shares no blocks", SCHED,
           "                    child = seq.fork()\n                    self.kv.fork(seq, child)\n"
           "                    children.append(child)",
           "                    child = seq.fork()\n                    children.append(child)"),
    Mutant("sched: a pruned beam keeps its blocks", SCHED,
           "                kv.free(seq)                       # pruned beam", "                pass                       # pruned beam"),
    Mutant("sched: the fast path never stops", SCHED,
           "                if status is not None:\n                    self._finish_seq(seq, status)\n"
           "                if request is not last_request:",
           "                if request is not last_request:"),
    Mutant("sched: first-token time moves every step", SCHED,
           "            if m.first_token_time is None:\n                m.first_token_time = now",
           "            m.first_token_time = now"),
    Mutant("sched: queue time not counted", SCHED,
           "                m.queue_time += max(0.0, now - m._queued_since)", "                pass"),
    Mutant("sched: a recomputed request's second wait not counted", SCHED,
           "        request.metrics._queued_since = now    # back in the queue",
           "        request.metrics._queued_since = None    # back in the queue"),
    Mutant("sched: outputs may be updated out of order", SCHED, "        if batch.out is not out:", "        if False:"),
    Mutant("sched: prefix hits not recorded", SCHED,
           "                kv.record_prefix_query(len(seq.token_ids), len(hits[seq.seq_id]) * bs)", "                pass"),
    Mutant("sched: an empty step drops its finished ids", SCHED,
           "            self._finished_ids = out.finished_request_ids + self._finished_ids",
           "            self._finished_ids = self._finished_ids"),
    Mutant("sched: a request wider than max_num_seqs is queued", SCHED,
           "        if slots > cfg.max_num_seqs:", "        if slots > cfg.max_num_seqs + 1:"),
]


def scratch_copy(dest: Path) -> None:
    """The checkout's tracked and untracked non-ignored files (what CI would see) under dest."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _limit_memory(gib: float):
    def limit() -> None:
        import resource
        cap = int(gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return limit


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutants whose name contains this text")
    parser.add_argument("--tests", nargs="+", default=["tests/core"], help="pytest paths [tests/core]")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant; past it: killed (a hang)")
    parser.add_argument("--memory-gib", type=float, default=8.0,
                        help="address-space limit of each test run (a mutant that loops allocating fails "
                             "with MemoryError instead of taking the machine) [8]")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in m.name]
    if args.list or not chosen:
        for m in chosen:
            print(f"{m.name}  ({m.path})")
        return 0 if chosen else 2
    survived = stale = known = 0
    with tempfile.TemporaryDirectory(prefix="mutation-sweep-") as tmp:
        copy = Path(tmp)
        scratch_copy(copy)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        where = subprocess.run([sys.executable, "-c", "import core; print(core.__file__)"], cwd=copy, env=env,
                               check=True, capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(copy)):
            print(f"error: the scratch copy imports core from {where}, not from {copy}", file=sys.stderr)
            return 2
        for i, m in enumerate(chosen):
            target = copy / m.path
            original = target.read_text()
            if original.count(m.old) != 1:
                stale += 1
                print(f"{i + 1:3d}/{len(chosen)} STALE     {m.name}: its snippet occurs {original.count(m.old)} times",
                      flush=True)
                continue
            target.write_text(original.replace(m.old, m.new))
            t0 = time.perf_counter()
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args.tests,
                                    *args.pytest_args], cwd=copy, env=env, capture_output=True, text=True,
                                   timeout=args.timeout, preexec_fn=_limit_memory(args.memory_gib))
                verdict = "killed" if r.returncode else "known" if m.known_survivor else "SURVIVED"
                tail = (r.stdout.strip().splitlines() or [""])[-1]
            except subprocess.TimeoutExpired:
                verdict, tail = "killed", f"(past --timeout {args.timeout:.0f} s: a hang)"
            finally:
                target.write_text(original)
            survived += verdict == "SURVIVED"
            known += verdict == "known"
            print(f"{i + 1:3d}/{len(chosen)} {verdict:<9} {m.name}  [{time.perf_counter() - t0:.0f} s] {tail}",
                  flush=True)
    print(f"{len(chosen) - survived - stale - known} killed, {survived} survived, {known} known survivors, "
          f"{stale} stale of {len(chosen)}")
    return 1 if survived or stale else 0


if __name__ == "__main__":
    sys.exit(run())
