"""Reading and writing checkpoint files.

    store               lazy read-only checkpoints (safetensors, weights-only pickles): name -> tensor
    safetensors_format  the safetensors header, parsed strictly
    writer              streaming safetensors writer: byte-range copies and computed tensors, shards
    output              atomic outputs: temporary path, moved into place only on success; locks, disk space
    resume              --resume: per-shard manifests in the temporary output, reused by a later run
    receipt             every output's receipt: command, options, sources' and outputs' BLAKE3
    digests             BLAKE3 of files, each file hashed once per process
    sample              --dry-run's sample run, in its child process
    mapped              stored tensors as views of mmap'd pages
    cache               this user's ffn-tools cache directory
    dtypes              dtype names across safetensors, torch and the command line
    nogc                large JSON and tokenizers built with the cyclic garbage collector paused
"""
