"""Operations tooling: build scripts, pipeline, benchmarks and the KV-event index."""
