"""How many bytes one token, and one block of tokens, occupies in the KV cache.

Every size in pagedkv -- the simulator's reservations, the engine's pool size from a memory
budget, the users-per-GPU figures -- is derived from this one number, so it lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int8": 1,
}
#: bytes of scale per token, KV head and key/value that a quantized dtype stores beside its
#: elements (one float32 per token and head; see ``pagedkv.attention.quant`` for why)
SCALE_BYTES: dict[str, int] = {"float8": 4, "int8": 4}
#: ``kv_cache_dtype`` option -> the KVSpec dtype stored; "auto" stores the model's own dtype
QUANTIZED_KV_DTYPES: dict[str, str] = {"fp8": "float8", "int8": "int8"}
KV_CACHE_DTYPE_NAMES: tuple[str, ...] = ("auto", *QUANTIZED_KV_DTYPES)


@dataclass(frozen=True)
class KVSpec:
    """The shape of one token's keys and values across all layers.

    The factor 2 in :attr:`bytes_per_token` is the key *and* the value: queries are never
    cached, they are recomputed every step. The quantized dtypes (``float8``, ``int8``) count
    their per-token, per-head scales too.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVSpec.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVSpec.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token, KV head and key/value (0 for an unquantized dtype)."""
        return SCALE_BYTES.get(self.dtype, 0)

    @property
    def bytes_per_token(self) -> int:
        per_head = self.head_dim * self.dtype_bytes + self.scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def blocks_in(self, memory_bytes: int, block_size: int) -> int:
        """How many whole blocks fit in ``memory_bytes`` of KV memory."""
        return memory_bytes // self.bytes_per_block(block_size)


#: The seeds' GPT-style model: 32 layers, 32 heads of 128 dims, fp16 -> 512 KiB per token.
GPT_STYLE_7B = KVSpec(num_layers=32, num_kv_heads=32, head_dim=128, dtype="float16")


def parse_bytes(text: str | int) -> int:
    """Parse '2GiB', '512MB', '80GB', '1e9' or an int into bytes (binary and decimal units)."""
    if isinstance(text, int):
        return text
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number) :]
    if unit not in units or not number:
        raise ValueError(f"cannot parse a byte size from {text!r}; use e.g. '2GiB', '512MB' or '1000000'")
    return int(float(number) * units[unit])
