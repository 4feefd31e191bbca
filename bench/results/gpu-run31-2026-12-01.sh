# bench/peers on the H200 machine's 16 CPU cores (no GPU used): the daemon before and
# after 3eb12c5 (the held file written when arenas are sent, not when lent), alternated.
export PATH=$PWD/build-ipbundle:$PATH
ip netns list >/dev/null || { echo "no ip netns"; exit 1; }
nproc; uptime
for k in 1 2; do
  for b in old new; do
    echo "=== $b (run $k)"
    build-ab/new/bench/peers -i 30 -c 0 -D build-ab/$b/deepepd 2>&1 | grep -E "warm:|rendezvous|target|2-node job, 2\+2|wait"
  done
done
