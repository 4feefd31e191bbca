# mps.sh — sourced by the GPU passes (bench/gpu-*.sh): start and stop the MPS
# control daemon as DEVICE.md says, the ranks started between the two being
# its clients.  Daemons (deepepd) must be started outside it: with these
# variables unset in their environment.
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog
  nvidia-cuda-mps-control -d && echo "== MPS started"
}
mps_off() {
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  echo "== MPS stopped"
}
