"""splitkv wired into serving engines: :mod:`splitkv.integrations.sglang`."""
