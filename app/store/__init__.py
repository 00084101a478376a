"""What lives on disk: durable files, the answer cache, paths and names, hashing, rank ownership."""
