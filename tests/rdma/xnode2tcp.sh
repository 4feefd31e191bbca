#!/usr/bin/env bash
# xnode2tcp.sh — xnode2.sh with node 2 on transport: tcp and one data
# connection each way (XNODE2_MIXED=1): node 1 has RDMA and tries its data
# queue pair, which cannot connect; it must spend that offer's token on a
# TCP data connection instead (with one connection a side it has no other),
# and every operation passes over TCP as it does over RDMA.
# rdmavm: nodes=2 timeout=420
XNODE2_MIXED=1
. tests/rdma/xnode2.sh
