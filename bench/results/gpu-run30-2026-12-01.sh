set -x
B=build-gpu-me
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ls /dev/infiniband 2>&1 | head -3
export DEP_BUILD=$PWD/$B DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda
for s in rdma memory cuda_ops lifecycle; do CK_RUN_SUITE=$s timeout 200 $B/check_deepepd 2>&1 | grep -E "^Checks|:F:|:E:|dma_buf|skipped" | head -12; done
