"""The client side: `Client` (HTTP, httpx), the `ocr-latent` command (`cli`) and the `.olc` codes file
(`codesfile`). Nothing here imports torch when imported; `Client` loads httpx only when asked for."""


def __getattr__(name: str):
    if name in ("Client", "ClientError", "Unreachable", "ApiError"):
        from ocr_latent.client import http_client
        return getattr(http_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
