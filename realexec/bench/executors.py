"""`python -m realexec bench executors`: what the executor boundary costs.

1. Serialization of real step messages (a prefill step and a decode step at batch 256):
   msgspec MessagePack vs pickle protocol 5, bytes and encode+decode µs.
2. Broadcast transport to 2 reader processes that answer like a driver rank: one pipe per
   rank (what MultiprocExecutor uses) vs a shared-memory ring that readers poll.
3. uni / mp / ray on a tiny random Llama at batch 1, 32, 256: step-message bytes per step,
   per-step RPC overhead (the executor's time per step minus the driver worker's own time
   inside execute_model) and generated tokens/s.
4. SmolLM2-135M decode at batch 32: uni TP=1, mp TP=1 (overhead vs the step) and mp TP=3.
`--quick` shrinks every part.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import struct
import tempfile
import time
from multiprocessing import shared_memory

from core import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    parser.add_argument("--backends", default="uni,mp,ray", help="comma-separated subset of uni,mp,ray")
    parser.add_argument("--batches", default="1,32,256", help="batch sizes for the tiny model")
    parser.add_argument("--skip-smollm2", action="store_true", help="skip the SmolLM2 TP=1 vs TP=3 part")
    parser.add_argument("--skip-transport", action="store_true", help="skip the pipe vs shared-memory part")


# ----------------------------------------------------------------------------- 1. serialization

def sample_messages(batch: int = 256, prompt_len: int = 64):
    """(prefill message, decode message) of a real scheduler at `batch` sequences."""
    from core import CacheConfig, EngineCore, Request, Scheduler, SchedulerConfig
    from core.step_message import StepMessageBuilder
    from policies import PolicySet

    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                                      max_model_len=2048),
                      CacheConfig(block_size=16, num_gpu_blocks=batch * 8), PolicySet())
    builder = StepMessageBuilder()
    msgs = []

    class Recorder:
        def execute_model(self, out):
            from core.step_message import ModelRunnerOutput
            msgs.append(builder.build(out))
            return ModelRunnerOutput(token_ids={s.seq.seq_id: [7] for s in out.scheduled if s.num_samples})

    engine = EngineCore(sched, Recorder())
    for i in range(batch):
        engine.add_request(Request(f"r{i}", [(i * 7 + j) % 32000 for j in range(prompt_len)],
                                   SamplingParams(max_tokens=8, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    return msgs[0], msgs[2]


def bench_serialization(reps: int) -> list[tuple]:
    from realexec.executor.serialization import (decode_step, decode_step_map, decode_step_pickle, encode_step,
                                        encode_step_map, encode_step_pickle)
    rows = []
    for name, msg in zip(("prefill b=256", "decode b=256"), sample_messages()):
        for codec, enc, dec in (("msgspec arrays (used)", encode_step, decode_step),
                                ("msgspec maps", encode_step_map, decode_step_map),
                                ("pickle-5", encode_step_pickle, decode_step_pickle)):
            data = enc(msg)
            t0 = time.perf_counter()
            for _ in range(reps):
                dec(enc(msg))
            rows.append((name, codec, len(data), (time.perf_counter() - t0) / reps * 1e6))
    return rows


# ----------------------------------------------------------------------------- 2. transport

def _pipe_reader(conn, rank: int) -> None:
    while True:
        data = conn.recv_bytes()
        if data == b"X":
            return
        if rank == 0:
            conn.send_bytes(b"k")


def _shm_reader(name: str, size: int, rank: int, reply) -> None:
    shm = shared_memory.SharedMemory(name=name)
    buf = shm.buf
    seen = 0
    try:
        while True:
            seq, n = struct.unpack_from("QQ", buf, 0)
            if seq == seen:
                time.sleep(0)                      # poll: yield the core, then look again
                continue
            seen = seq
            payload = bytes(buf[16:16 + n])
            if payload == b"X":
                return
            if rank == 0:
                reply.send_bytes(b"k")
    finally:
        del buf
        shm.close()


def bench_transport(num_readers: int, reps: int, size: int) -> list[tuple]:
    """Round trip (broadcast to every reader, the driver answers) in µs per message."""
    ctx = mp.get_context("spawn")
    payload = b"m" * size
    rows = []
    # One pipe per rank.
    pipes, procs = [], []
    for r in range(num_readers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_pipe_reader, args=(b, r), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    for _ in range(20):
        for c in pipes:
            c.send_bytes(payload)
        pipes[0].recv_bytes()
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in pipes:
            c.send_bytes(payload)
        pipes[0].recv_bytes()
    rows.append(("pipe per rank", size, (time.perf_counter() - t0) / reps * 1e6))
    for c in pipes:
        c.send_bytes(b"X")
    for p in procs:
        p.join(5)
    # Shared-memory ring (one slot: the writer waits for the driver's answer anyway).
    shm = shared_memory.SharedMemory(create=True, size=16 + size)
    reply_r, reply_w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_shm_reader, args=(shm.name, size, r, reply_w), daemon=True)
             for r in range(num_readers)]
    for p in procs:
        p.start()
    seq = 0

    def publish(data: bytes) -> None:
        nonlocal seq
        seq += 1
        shm.buf[16:16 + len(data)] = data
        struct.pack_into("QQ", shm.buf, 0, seq, len(data))

    try:
        for _ in range(20):
            publish(payload)
            reply_r.recv_bytes()
        t0 = time.perf_counter()
        for _ in range(reps):
            publish(payload)
            reply_r.recv_bytes()
        rows.append(("shm ring, polling readers", size, (time.perf_counter() - t0) / reps * 1e6))
        publish(b"X")
        for p in procs:
            p.join(5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shm.close()
        shm.unlink()
    return rows


# ----------------------------------------------------------------------------- 3./4. engines

def tiny_checkpoint(path: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return path


class _CountingBytes:
    """For the uni executor (which passes the message object): count what it would send."""

    def __init__(self, executor):
        from realexec.executor.serialization import encode_step
        inner = executor._execute

        def counted(msg):
            executor.message_bytes += len(encode_step(msg))
            return inner(msg)
        executor._execute = counted


def measure(llm, batch: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    """Generate `max_tokens` tokens for `batch` prompts; per-step costs of the decode steps."""
    engine = llm.engine
    ex = engine.executor
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i * 13 + j) % (vocab - 3) + 3 for j in range(prompt_len)], params)
    engine.step()                                           # the prefill step: not counted
    w0 = ex.collective_rpc("get_timings")[0]["execute_s"]
    e0, s0, b0, t0 = ex.execute_time, ex.num_steps, ex.message_bytes, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    steps = ex.num_steps - s0
    worker = ex.collective_rpc("get_timings")[0]["execute_s"] - w0
    return {"bytes_per_step": (ex.message_bytes - b0) / steps,
            "step_ms": (ex.execute_time - e0) / steps * 1e3,
            "worker_ms": worker / steps * 1e3,
            "overhead_us": ((ex.execute_time - e0) - worker) / steps * 1e6,
            "tok_s": batch * (max_tokens - 1) / wall}


def make_llm(model: str | None, backend: str, tp: int, **kw):
    from realexec import LLM
    llm = LLM(model=model, tensor_parallel_size=tp, distributed_executor_backend=backend, **kw)
    if backend == "uni":
        _CountingBytes(llm.engine.executor)
    return llm


def run(args) -> int:
    quick = args.quick
    backends = [b for b in args.backends.split(",") if b]
    batches = [int(b) for b in args.batches.split(",")]
    print("## serialization of a real step message (encode + decode)")
    print("| message | codec | bytes | µs |\n|---|---|---:|---:|")
    for name, codec, size, us in bench_serialization(20 if quick else 200):
        print(f"| {name} | {codec} | {size} | {us:.0f} |")

    if not args.skip_transport:
        print("\n## broadcast to 2 ranks + the driver's answer (round trip)")
        print("| transport | message bytes | µs |\n|---|---:|---:|")
        for size in (256, 16384):
            for name, n, us in bench_transport(2, 200 if quick else 2000, size):
                print(f"| {name} | {n} | {us:.0f} |")

    max_tokens = 8 if quick else 32
    print(f"\n## tiny random Llama (2 layers, hidden 64), TP=1, prompt 16, {max_tokens} tokens, decode steps")
    print("| backend | batch | msg bytes/step | step ms | worker ms | RPC overhead µs | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_checkpoint(tmp)
        for backend in backends:
            llm = make_llm(model, backend, 1, block_size=16, num_gpu_blocks=2048, max_num_seqs=256)
            try:
                for batch in batches:
                    r = measure(llm, batch, 16, max_tokens, 512)
                    print(f"| {backend} | {batch} | {r['bytes_per_step']:.0f} | {r['step_ms']:.2f} | "
                          f"{r['worker_ms']:.2f} | {r['overhead_us']:.0f} | {r['tok_s']:.0f} |", flush=True)
            finally:
                llm.shutdown()

    if not args.skip_smollm2:
        tokens = 6 if quick else 16
        print(f"\n## SmolLM2-135M decode, batch 32, prompt 32, {tokens} tokens")
        print("| backend | TP | step ms | worker ms | RPC overhead µs | overhead / step | tok/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for backend, tp in (("uni", 1), ("mp", 1), ("mp", 3)):
            llm = make_llm(None, backend, tp, block_size=16, kv_cache_memory=0.1, swap_space=0.01)
            try:
                r = measure(llm, 32, 32, tokens, 49152)
                print(f"| {backend} | {tp} | {r['step_ms']:.1f} | {r['worker_ms']:.1f} | {r['overhead_us']:.0f} | "
                      f"{r['overhead_us'] / 1e3 / r['step_ms']:.1%} | {r['tok_s']:.0f} |", flush=True)
            finally:
                llm.shutdown()
    return 0
