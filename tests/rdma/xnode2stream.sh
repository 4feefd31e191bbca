#!/usr/bin/env bash
# xnode2stream.sh — xnode2.sh with both daemons streaming in chunks of one
# row (XNODE2_CHUNK=1): a throughput call's rows between the nodes go chunk
# by chunk as RDMA writes (rows, then the chunk's mark, the first with the
# slot), and each receiver's credit comes back as an RDMA write into the
# sender's out slot; every operation still matches the oracle and the same
# job on one node, bit for bit, and no frame goes over TCP.
# rdmavm: nodes=2 timeout=420
XNODE2_CHUNK=1
. tests/rdma/xnode2.sh
