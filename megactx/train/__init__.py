"""Training: the data we build ourselves (`corpus`: the stdlib code corpus and its split;
`tokenizer`: the byte-level BPE with the chat template; `data`: token cache, packing, sharding,
bits per byte; `needles`: synthetic long-context retrieval tasks), the losses, the trainer and the
DSA/IndexShare recipe."""
