from selfspec.cache.kv import KVCache

__all__ = ["KVCache"]
