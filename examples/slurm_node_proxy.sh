# This node's `inferproxy serve`, for a Slurm job script: source it (datatrove's `env_command` does)
# before the tasks start. It starts the proxy in the background, waits until it answers, and stops it
# when the job script exits. Slurm's scancel, preemption or time limit send SIGTERM to the job's
# processes, the proxy among them: it finishes the publications it started and gives up its ranks,
# and the job, run again (on this node or another), resumes them where they stopped.
#
#   source examples/slurm_node_proxy.sh PORT [inferproxy serve flags ...]
#
# Give the same --checkpoints-dir and --output to every node: on a shared filesystem (or --output on
# object storage), a rank rerun on another node resumes there. The upstream (--upstream) is this
# node's vLLM or SGLang server, started before this (by the same job script, or a service).
_inferproxy_port=$1
shift
inferproxy serve --host 127.0.0.1 --port "$_inferproxy_port" "$@" &
_inferproxy_pid=$!
trap 'kill -TERM "$_inferproxy_pid" 2>/dev/null; wait "$_inferproxy_pid"' EXIT
_inferproxy_waited=0
until python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" \
    "http://127.0.0.1:$_inferproxy_port/healthz" 2>/dev/null; do
  if ! kill -0 "$_inferproxy_pid" 2>/dev/null; then
    echo "inferproxy serve exited before it answered: its error is above" >&2
    exit 1
  fi
  _inferproxy_waited=$((_inferproxy_waited + 1))
  if [ "$_inferproxy_waited" -ge 600 ]; then
    echo "inferproxy serve did not answer on port $_inferproxy_port within 5 minutes" >&2
    exit 1
  fi
  sleep 0.5
done
