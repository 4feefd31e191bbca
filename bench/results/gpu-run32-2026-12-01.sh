# make check-gpu on HEAD after the kernel-cache warm-up's pool_forget fix (issue 16 found 13
# GPU failures before it), the stats page and the RDMA-capable allocations: the whole
# GPU-tagged suite under MPS, one bounded pass.
B=build-gpu-h
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
DEP_BUILD=$PWD/$B DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda timeout 230 $B/check_deepepd > $OUT/check-gpu.log 2>&1
echo "check rc $?"
echo quit | nvidia-cuda-mps-control
grep -E "^Checks|:F:|:E:" $OUT/check-gpu.log | head -30
grep -A40 "^Skipped" $OUT/check-gpu.log | head -20
