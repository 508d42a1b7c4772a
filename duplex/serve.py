"""``python -m duplex.serve``: the settings, the app (:mod:`duplex.app`) and uvicorn.

Everything is imported by :func:`main`, not at the top: the pipeline's stage processes are
spawned, and a spawned process first imports its parent's main module, this one. Imported at the
top, the app's modules (FastAPI, aiortc, the session layer: ~1.2 s) would load in every stage
process of every server start, and no stage uses them.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    import logging
    import sys
    from pathlib import Path

    import uvicorn

    from duplex.app import WS_MAX_BYTES, WebSocketProtocol, create_app
    from duplex.logs import hide_secrets, setup_logging
    from duplex.settings import load_preset
    from duplex.transports.webrtc.ice import IcePolicy, parse_ice_server
    from pipeline.config import ConfigError

    log = logging.getLogger(__name__)
    setup_logging()
    try:
        preset = load_preset(argv)
        settings = preset.settings
        policy = IcePolicy(tuple(parse_ice_server(u) for u in settings.ice_server), tuple(settings.ice_host))
        if settings.record_dir is not None:  # refused now rather than at the first call
            Path(settings.record_dir).mkdir(parents=True, exist_ok=True)
        app = create_app(preset, policy)
    except (ConfigError, ValueError, OSError) as err:
        print(f"duplex: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    hide_secrets(settings.api_key, settings.twilio_auth_token, settings.call_webhook_secret,
                 *(server.credential for server in policy.servers))
    log.info("preset %s: %s", settings.preset, preset.description or "(no description)")
    if settings.record_dir is not None:
        log.info("recording every call to %s", settings.record_dir)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        ws=WebSocketProtocol,
        ws_max_size=WS_MAX_BYTES,
        # The proxy headers are read by duplex.client_address.ProxyHeaders, from
        # --forwarded-allow-ips only (uvicorn's own would trust 127.0.0.1 by default).
        proxy_headers=False,
        log_config=None,
    )


if __name__ == "__main__":
    main()
