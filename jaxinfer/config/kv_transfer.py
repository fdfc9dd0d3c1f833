"""KVTransferConfig: this engine's part in disaggregated prefill/decode (KV moved between engines).

    EngineConfig(kv_role="prefill", kv_transfer_host="10.0.0.5")

A request may ask a server to compute its prompt for another (`kv_transfer_params` with
`do_remote_decode`: the pages are held for a pull, and the answer carries what the other side
needs) or to decode from a prompt another server computed (`do_remote_prefill`: the pages are
pulled over `jax.experimental.transfer` before the sequence starts). `kv_role` says which of the
two this engine takes (both by default); where it is given, the transfers' gathers and scatters
compile at warm-up, else on the first transfer. The pages move over a transfer server and a small
ZMQ channel bound on `kv_transfer_host`, which the other engine must reach. A decode engine that
does not get the pages in `kv_transfer_timeout` seconds (the prefill server gone, the offer
expired) computes the prompt itself; a prefill engine gives up an offer nobody pulled after
`kv_transfer_ttl` seconds (or sooner, oldest first, where its held copies would pass half its
KV pool's pages).
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.config.checks import one_of
from jaxinfer.options import option

KV_ROLES = ("both", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """This engine's role in disaggregated prefill/decode and where its pages are offered."""

    TITLE = "disaggregated prefill/decode"

    kv_role: str | None = option(
        None,
        "this server's part in disaggregated prefill/decode: prefill (computes prompts and holds their KV "
        "pages for a decode server to pull), decode (pulls them and decodes) or both; given, the transfers "
        "compile at warm-up (default: both, compiled on the first transfer)",
        choices=KV_ROLES,
    )
    kv_transfer_host: str = option(
        "127.0.0.1", "address the KV transfer server and its side channel bind (other servers pull from it)"
    )
    kv_transfer_timeout: float = option(
        5.0, "seconds a decode server waits for a prefill server's KV pages before computing the prompt itself"
    )
    kv_transfer_ttl: float = option(60.0, "seconds a prefill server holds KV pages no decode server pulled")

    def __post_init__(self):
        if self.kv_role is not None:
            one_of(self, "kv_role", KV_ROLES)
        if not isinstance(self.kv_transfer_host, str) or not self.kv_transfer_host.strip():
            raise ValueError(
                f"EngineConfig.kv_transfer_host must be a host name or address, got {self.kv_transfer_host!r}"
            )
        for name in ("kv_transfer_timeout", "kv_transfer_ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"EngineConfig.{name} must be a number of seconds > 0, got {value!r}")

    @property
    def role(self) -> str:
        return self.kv_role or "both"

    def produces(self) -> bool:
        """Whether this engine computes prompts for others."""
        return self.role in ("both", "prefill")

    def consumes(self) -> bool:
        """Whether this engine decodes from prompts others computed."""
        return self.role in ("both", "decode")
