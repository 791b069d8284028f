"""The reference for bench/replay_speed.py: a minimal OrderedDict prefix-cache simulator.

One LRU tier (head-first), docs/definitions.md lookup (prefix hit stops at the first missing block;
hit tokens = min(k·B, input_length)), then touch/insert head → tail, then evict to
capacity. Reads Mooncake JSONL with the standard json module. Prints the token hit ratio.

    python bench/replay_minimal_sim.py TRACE CAPACITY_BLOCKS BLOCK_TOKENS
"""

import json
import sys
from collections import OrderedDict


def main() -> None:
    path, cap, block_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    od: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            keys, n = rec["hash_ids"], rec["input_length"]
            k = 0
            for key in keys:
                if key not in od:
                    break
                k += 1
            hit += min(k * block_tokens, n)
            total += n
            for key in keys:
                if key in od:
                    od.move_to_end(key)
                else:
                    od[key] = None
            while len(od) > cap:
                od.popitem(last=False)
    print(hit / total)


if __name__ == "__main__":
    main()
