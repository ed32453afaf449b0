"""`python -m realexec serve` flags and runner (registered in realexec/cli.py's COMMANDS table)."""
from __future__ import annotations

import argparse
import sys

SERVE_HELP = "OpenAI-compatible HTTP server (completions, chat, models, health, metrics)"
BENCH_SERVE_HELP = "serving benchmark: stream a trace's requests at a rate to an OpenAI-compatible server"


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from realexec.config import add_engine_args
    from realexec.server.config import add_server_args

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to listen on [127.0.0.1]")
    g.add_argument("--port", type=int, default=8000, help="TCP port [8000]")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported in /v1/models and metrics "
                        "(default: SmolLM2-135M-Instruct for the embedded model, else the --model path's name)")
    g.add_argument("--replicas", type=int, default=1,
                   help="with --simulate: serve this many simulated replicas from one process, each its own "
                        "engine, app and metrics, on ports PORT .. PORT+N-1 (a router test bed) [1]")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level [info]")
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from realexec.config import engine_args_from_namespace
    from realexec.server.config import server_config_from_namespace

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        if args.simulate is None:
            raise ValueError("--replicas N serves simulated engines: add --simulate COST_MODEL (real replicas "
                             "would share one device: start one server per device instead)")
        if args.port == 0 or args.port + args.replicas - 1 > 65535:
            raise ValueError(f"--replicas {args.replicas} needs ports {args.port}..{args.port + args.replicas - 1}: "
                             f"give a --port from 1 to {65536 - args.replicas}")
    engine_args = engine_args_from_namespace(args)
    engine_args.validate()                     # bad flags fail before torch and the model load
    config = server_config_from_namespace(args)
    config.validate()

    import uvicorn

    from realexec.engine.llm_engine import LLMEngine, freeze_startup_heap, keep_freed_memory
    from realexec.server.app import create_app, default_served_model_name
    from realexec.server.lifecycle import DrainingServer

    if engine_args.simulate is not None:
        from realexec.server.replicas import ReplicaServer, run_replicas
        server_class = ReplicaServer
    else:
        server_class = DrainingServer
    engines, apps, servers = [], [], []
    for i in range(args.replicas):
        engine = LLMEngine(engine_args)
        if engine_args.simulate is not None:
            sim = engine.executor.deployment
            default_name = sim.name if sim.spec is not None else default_served_model_name(engine_args.model)
        else:
            default_name = default_served_model_name(engine_args.model)
        names = args.served_model_name or [default_name]
        app = create_app(engine, served_model_name=names, config=config)
        port = args.port + i
        what = f"simulated ({sim.description}) " if engine_args.simulate is not None else ""
        print(f"twinserve: serving {what}{names[0]!r} (max_model_len {engine.max_model_len}, "
              f"{engine.scheduler.cache_config.num_gpu_blocks} KV blocks of {engine_args.block_size}"
              f"{', API key required' if config.api_key else ''}) on http://{args.host}:{port}/v1", flush=True)
        engines.append(engine)
        apps.append(app)
        servers.append(server_class(uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                                                   timeout_graceful_shutdown=5),
                                    drain=app.state.server.drain, shutdown_timeout=config.shutdown_timeout))
    frozen = freeze_startup_heap()             # no 0.2 s full garbage collection inside a step
    keep_freed_memory()                        # no page faults for every step's activations
    print(f"twinserve: {frozen} startup objects kept out of the garbage collector", flush=True)
    if len(servers) == 1 and engine_args.simulate is None:
        servers[0].run()
    else:
        run_replicas(servers)
    code = 0
    for engine, app in zip(engines, apps):
        used = engine.scheduler.kv.stats().num_used_gpu_blocks
        if used:                               # every request has ended: these leaked (a bug)
            failed = app.state.server.engine.error
            why = f"the engine failed: {failed!r}" if failed else "leaked: every request has ended"
            print(f"twinserve: stopped; {used} KV blocks still in use at exit ({why}); exit code 1",
                  file=sys.stderr, flush=True)
            code = 1
    if not code:
        print("twinserve: stopped; 0 KV blocks in use", flush=True)
    return code
