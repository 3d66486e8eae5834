"""The engine side of KV offloading: lookups at admission, loads, stores, events."""
