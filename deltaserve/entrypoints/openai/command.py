"""`deltaserve serve`: its options (beside the engine options that generate has) and the command itself.

Nothing heavy is imported here at module level, so `deltaserve --help` stays fast."""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import os
import socket

API_KEY_ENV = "DELTASERVE_API_KEY"


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model as given)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond the --max-num-seqs running ones; more are answered 429")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies are answered 413 (default: 16 bytes a token of the model's length "
                        "plus 1 MiB, at least 4 MiB, so that a prompt filling the context fits as token ids or "
                        "typical text)")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so that the HTTP handlers never slow its steps "
                        "(default: on); off: in a thread of the server's process (always so with "
                        "--tensor-parallel-size > 1)")


def server_config(args):
    """The validated ServerConfig of the parsed arguments (ValueError names the bad option)."""
    from deltaserve.entrypoints.openai.serving import ServerConfig

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty; pass a non-empty key, or leave it out to serve without one")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: must be in [0, 65535]")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue {args.max_queue}: must be >= 0")
    if args.max_body_bytes is not None and args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes {args.max_body_bytes}: must be at least 1024")
    if args.drain_timeout <= 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout}: must be > 0 seconds")
    return ServerConfig(served_model_name=args.served_model_name or args.model or "demo-model", api_key=api_key,
                        max_body_bytes=args.max_body_bytes, max_queue=args.max_queue, default_seed=args.seed,
                        sampling_defaults=_sampling_defaults(args.model))


def _sampling_defaults(model: str | None) -> dict:
    """The model folder's generation_config.json sampling defaults (said in the log: they change what a request
    that sends no temperature gets, as in vLLM)."""
    from deltaserve.entrypoints.llm import BUNDLED_MODEL
    from deltaserve.sampling_params import generation_defaults

    folder = model or BUNDLED_MODEL
    defaults = generation_defaults(folder)
    if defaults:
        logging.getLogger("deltaserve").info(
            "sampling defaults from %s/generation_config.json (for fields a request leaves out): %s", folder,
            ", ".join(f"{name} {value}" for name, value in defaults.items()))
    return defaults


def bind_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not listening yet: connections are refused until the server starts. The
    family is uvicorn's choice: IPv6 when the host holds a colon, else IPv4 (`localhost` is 127.0.0.1 whichever
    address the resolver lists first). So a port another server listens on, a host that does not resolve or is not
    this machine's, or a privileged port fails at once, in one line, before the model loads (uvicorn binds only
    after: a GPU's start-up spent first, then its multi-line log and exit code 3). Two servers starting together on
    one port both bind (Linux lets sockets with SO_REUSEADDR share a port until one listens); the second fails when
    it listens."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        address = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0][4]
    except OSError as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror or e}); pass an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0 for every interface") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
        sock.bind(address)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        fix = {errno.EADDRNOTAVAIL: "pass an address of this machine with --host (0.0.0.0: every interface)",
               errno.EACCES: "a port below 1024 needs privileges: pass --port 1024 or above"}.get(
                   e.errno, "pass another --port, or stop what holds it")
        raise ValueError(f"cannot listen on {where} ({e.strerror or e}); {fix}") from None
    return sock


def cmd_serve(args, make_llm, engine_arguments) -> None:
    """Bind the address, start the engine (in its own process, from engine_arguments(args); else in this one:
    make_llm(args), as generate does), then serve until SIGINT/SIGTERM."""
    config = server_config(args)
    # the ranks of torchrun other than 0 never serve (they run the workers' loop inside make_llm)
    rank = int(os.environ.get("RANK", "0"))
    with bind_address(args.host, args.port) if rank == 0 else contextlib.nullcontext() as sock:
        if args.engine_process and args.tensor_parallel_size == 1:
            from deltaserve.core.engine_process import EngineProcess

            process = EngineProcess(functools.partial(engine_arguments, args))  # starts now, beside the imports below
            try:
                from deltaserve.entrypoints.openai.api_server import run_server

                run_server(process, config, sock, args.drain_timeout)
            finally:
                process.close()
            return
        from deltaserve.entrypoints.openai.api_server import run_server

        llm = make_llm(args)
        try:
            run_server(llm.engine, config, sock, args.drain_timeout)
        finally:
            llm.shutdown()
