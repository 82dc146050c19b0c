"""Whether the Hugging Face Hub can be reached, decided in milliseconds rather than after minutes of retries."""

import os
import socket
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0
TRUTHY = {"1", "ON", "YES", "TRUE"}


def hub_unavailable_reason() -> str | None:
    """None when the Hub looks reachable; otherwise why not, for an error message.

    Behind a proxy a direct probe proves nothing, so then we rely on the Hub client's own timeouts.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUTHY:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{url.hostname} cannot be reached ({exc.strerror or exc})"
    return None
