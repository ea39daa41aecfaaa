#!/usr/bin/env python3
"""The hub cache as the official huggingface_hub package sees it, for the test that kvq shares
it: `fetch` downloads files of a repo through huggingface_hub (HF_ENDPOINT and HF_HOME from the
environment); `find` looks files up in the cache alone, as transformers does offline.

Usage: hf_cache.py fetch|find REPO FILE [FILE...]
Prints, per file, its sha256 and its path in the cache; exits non-zero if one is missing.
"""
import hashlib
import sys

from huggingface_hub import hf_hub_download, try_to_load_from_cache


def main() -> int:
    mode, repo, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    missing = 0
    for name in files:
        if mode == "fetch":
            path = hf_hub_download(repo_id=repo, filename=name)
        else:
            path = try_to_load_from_cache(repo_id=repo, filename=name)
        if not isinstance(path, str):
            print(f"missing {name}")
            missing += 1
            continue
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        print(f"{digest} {path}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
