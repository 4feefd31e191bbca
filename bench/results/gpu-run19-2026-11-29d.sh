#!/bin/bash
# device run 19 (2026-11-29, nvidia-h200-x4): is the cross-device mapping cost per peer GPU?
B=$(cd "$(dirname "$0")" && pwd)
timeout 60 $B/vmm_map -g 4 -s 450 -i 8
timeout 60 $B/vmm_map -g 4 -s 450 -i 8 -w
timeout 60 $B/vmm_map -g 4 -s 1024 -c 256 -i 8 -w
