"""Running the transformers server: load the checkpoint, serve `app.build_app` with uvicorn on a bound socket,
its connections admitted and timed out by `connections.guarded_protocol`.

It stops on SIGTERM/SIGINT with status 0 and reports what it served (`batches`, `requests`).
"""

from __future__ import annotations

import signal
import threading

from data.progress import progress_enabled
from evaluation.serving.app import build_app
from evaluation.serving.connections import guarded_protocol
from evaluation.serving.guards import ServerLimits
from evaluation.serving.scheduler import Scheduler


def run_server(
    checkpoint: str,
    *,
    sock,
    host: str,
    model_name: str,
    max_batch_size: int,
    on_ready,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
) -> dict:
    """Load `checkpoint`, serve it on the listening socket `sock` until SIGTERM/SIGINT.

    Returns `{"batches", "requests"}`; `on_ready(url)` is called once the socket accepts requests.
    """
    limits = limits or ServerLimits()
    try:
        return _serve(checkpoint, sock, host, model_name, max_batch_size, on_ready, limits, api_key)
    finally:
        sock.close()


def _serve(checkpoint, sock, host, model_name, max_batch_size, on_ready, limits, api_key) -> dict:
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    from trainer.model_loading import load_model
    from trainer.recipe import ModelConfig
    from trainer.rollout.hf_engine import HFEngine

    if not progress_enabled():
        hf_logging.disable_progress_bar()  # a log file (or CI) gets no progress bars
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(
        checkpoint, ModelConfig(dtype="float32" if device == "cpu" else "auto"), device
    )
    model.eval()
    scheduler = Scheduler(
        HFEngine(model, tokenizer),
        max_batch_size=max_batch_size,
        max_batch_sequences=limits.max_sequences,
        max_active_sequences=limits.max_active_sequences,
    )
    app = build_app(
        tokenizer,
        model_name,
        scheduler,
        getattr(model.config, "max_position_embeddings", None),
        limits,
        api_key,
    )
    url_host = f"[{host.strip('[]')}]" if ":" in host else host
    url = f"http://{url_host}:{sock.getsockname()[1]}/v1"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                on_ready(url)

    # connections are admitted and timed out by our protocol (connections.py), not by uvicorn's
    # limit_concurrency, which counted idle connections and had none closed
    server = Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            lifespan="off",
            http=guarded_protocol(limits),
            timeout_keep_alive=limits.keep_alive_timeout_s,
        )
    )
    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers take it instead,
    # so the process ends with status 0 and can report what it served.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()
        if main_thread:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return {"batches": scheduler.batches, "requests": scheduler.requests}
