"""Solutions to notebook 01's exercises."""


def kv_bytes(p) -> int:
    """Every prefix key and value once: tokens x KV heads x (D + Dv) x bytes per element of the pool."""
    return sum(p.prefix_lens) * p.num_kv_heads * (p.head_dim + p.v_head_dim) * p.k_buffer.element_size()


def bytes_in_flight(kv_bytes: float, time_us: float, latency_ns: float) -> float:
    """Little's law: bytes in flight = bandwidth x latency, with the bandwidth the kernel achieved."""
    return kv_bytes / (time_us * 1e-6) * (latency_ns * 1e-9)
