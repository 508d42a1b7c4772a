"""Suite-wide settings: quiet chatty libraries in captured logs."""

import logging

for _name in ("httpx", "aioice.ice", "httpcore"):
    logging.getLogger(_name).setLevel(logging.WARNING)
