"""zenserve engine: token ids in, token ids out."""
