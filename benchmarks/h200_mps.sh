#!/usr/bin/env bash
# MPS under krexd on one real GPU, one device call (carry .whl), about 4 minutes:
#  1. `krex daemon start --mps`: the control daemon krexd starts (its pid file, its pipe dir)
#     and `krex status`'s MPS lines;
#  2. a torch command under `krex run`, timing in a region: an MPS client (the server holds
#     the context), the region clean, the MPS variables it was given;
#  3. context creation with 8, 16 and 32 processes starting at once, without MPS and as
#     clients of the control daemon krexd started: seconds to the first finished kernel
#     (p50, max) and GPU memory per process;
#  4. faults on the real server: a client SIGKILLed while its kernels run (the command, then
#     a child of it), then the server
#     itself SIGKILLed under a running client; a region after each (does it run, is it
#     flagged), `krex status`'s MPS state and the journal's last records;
#  5. `krex daemon stop`: the control daemon gone with it.
# MPS_CONTEXTS=0 skips step 3. Everything comes back in $OUT; the last lines are the table (docs/results/mps/).
set -uo pipefail
REPO=$PWD; O=${OUT:-/tmp/krex-out}; mkdir -p "$O"
. benchmarks/h200_env.sh || exit 1
export KREX_STATE_DIR=/tmp/krexstate-mps
KREX=(python3 -m krex.cli.main)
cd /tmp
command -v nvidia-cuda-mps-control || { echo "no nvidia-cuda-mps-control"; exit 1; }

echo "== 1. krex daemon start --mps"
timeout 60 "${KREX[@]}" daemon start --device gpu --mps --slots-per-gpu 4 > "$O/start.log" 2>&1
echo "rc=$?"; tail -3 "$O/start.log"
"${KREX[@]}" status --json > "$O/status.json" 2>&1
PIPE=$(python3 -c "import json; d=json.load(open('$O/status.json')); print(d['daemon']['mps']['gpus'][0]['pipe_dir'])")
python3 -c "import json; print(json.load(open('$O/status.json'))['daemon']['mps'])"
ls -la "$PIPE" > "$O/pipe.txt"; cat "$O/pipe.txt"

echo "== 2. a region under MPS"
cat > /tmp/mps_region.py <<'EOF'
import json, os, subprocess, torch, krex
a = torch.randn(4096, 4096, device="cuda"); torch.cuda.synchronize()
with krex.region() as r:
    for _ in range(50):
        b = a @ a
    torch.cuda.synchronize()
smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.splitlines()[-6:]
print(json.dumps({"clean": r.clean, "flags": r.flags, "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                  "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "smi": smi}))
EOF
timeout 90 "${KREX[@]}" run --device gpu -- python3 /tmp/mps_region.py > "$O/region.json" 2> "$O/region.log"
echo "rc=$?"; cat "$O/region.json"; tail -3 "$O/region.log"
"${KREX[@]}" journal --json > "$O/journal.json" 2>/dev/null || "${KREX[@]}" journal > "$O/journal.txt" 2>&1

echo "== 3. context creation, N at once"
cat > /tmp/ctx.py <<'EOF'
import json, os, sys, time
import torch
base = sys.argv[1]
open(f"{base}.{os.getpid()}.ready", "w").close()
while not os.path.exists(base + ".go"):
    time.sleep(0.001)
t = time.time(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "ctx_s": time.time() - t}), flush=True)
while not os.path.exists(base + ".end"):
    time.sleep(0.01)
EOF
[ "${MPS_CONTEXTS:-1}" = 1 ] && python3 - "$PIPE" "$O" <<'EOF'
import glob, json, os, statistics, subprocess, sys, time
pipe, out = sys.argv[1], sys.argv[2]
def used_mib():
    r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                       capture_output=True, text=True)
    return float(r.stdout.split()[0])
rows = []
for mode in ("plain", "mps"):
    for n in (8, 16, 32):
        base = f"/tmp/ctx-{mode}-{n}"
        for f in glob.glob(base + "*"):
            os.unlink(f)
        env = dict(os.environ)
        env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
        if mode == "mps":
            env["CUDA_MPS_PIPE_DIRECTORY"] = pipe
        idle = used_mib()
        ps = [subprocess.Popen([sys.executable, "/tmp/ctx.py", base], env=env, stdout=subprocess.PIPE, text=True)
              for _ in range(n)]
        t0 = time.time()
        while len(glob.glob(base + ".*.ready")) < n and time.time() - t0 < 60:
            time.sleep(0.01)
        open(base + ".go", "w").close()
        got = []
        for p in ps:
            line = p.stdout.readline()
            if line:
                got.append(json.loads(line)["ctx_s"])
        time.sleep(0.5)
        mem = (used_mib() - idle) / n
        open(base + ".end", "w").close()
        for p in ps:
            p.wait(30)
        row = {"mode": mode, "n": n, "ok": len(got), "ctx_p50_s": round(statistics.median(got), 3) if got else None,
               "ctx_max_s": round(max(got), 3) if got else None, "mib_per_process": round(mem, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(out + "/contexts.json", "w"), indent=1)
EOF

echo "== 4. faults on the real MPS server"
cat > /tmp/mps_loop.py <<'EOF2'
import json, os, sys, time, torch, krex
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); torch.cuda.synchronize()
open(sys.argv[1], "w").close()
t_end = time.time() + float(sys.argv[2])
n = 0
try:
    while time.time() < t_end:
        for _ in range(20):
            b = a @ a
        torch.cuda.synchronize(); n += 1
    print(json.dumps({"loops": n, "error": None}))
except Exception as e:
    print(json.dumps({"loops": n, "error": str(e)[:200]}))
    sys.exit(3)
EOF2
after_region() {  # a region right after a fault: its flags, and whether it ran at all
  timeout 90 "${KREX[@]}" run --device gpu -- python3 /tmp/mps_region.py > "$O/$1.json" 2> "$O/$1.log"
  echo "$1 rc=$?"; cut -c1-300 "$O/$1.json"; tail -2 "$O/$1.log"
}
# a. an MPS client killed with SIGKILL while its kernels run
rm -f /tmp/mps_ready_a
timeout 60 "${KREX[@]}" run --device gpu -- python3 /tmp/mps_loop.py /tmp/mps_ready_a 30 > "$O/fault_client.json" 2> "$O/fault_client.log" &
for _ in $(seq 300); do [ -e /tmp/mps_ready_a ] && break; sleep 0.1; done; sleep 1
VICTIM=$(pgrep -f "mps_loop.py /tmp/mps_ready_a" | while read p; do [ "$(cat /proc/$p/comm)" = python3 ] && echo $p; done | tail -1)
echo "client victim pid=$VICTIM"; kill -9 "$VICTIM"; wait; echo "killed client's krex run rc=$?"
after_region after_client_kill
# a2. a client below the command (a child of its shell) killed with SIGKILL while its kernels run:
# krexd hears of it only through the child's record (it ended without its exit handlers)
rm -f /tmp/mps_ready_c
timeout 60 "${KREX[@]}" run --device gpu -- sh -c 'python3 /tmp/mps_loop.py /tmp/mps_ready_c 30 & wait $!' \
  > "$O/fault_child.json" 2> "$O/fault_child.log" &
for _ in $(seq 300); do [ -e /tmp/mps_ready_c ] && break; sleep 0.1; done; sleep 1
VICTIM=$(pgrep -f "mps_loop.py /tmp/mps_ready_c" | while read p; do [ "$(cat /proc/$p/comm)" = python3 ] && echo $p; done | tail -1)
echo "child client victim pid=$VICTIM"; kill -9 "$VICTIM"; wait; echo "killed child's krex run rc=$?"
sleep 0.5
after_region after_child_kill
# b. the MPS server killed with SIGKILL while a client runs
rm -f /tmp/mps_ready_b
timeout 60 "${KREX[@]}" run --device gpu -- python3 /tmp/mps_loop.py /tmp/mps_ready_b 20 > "$O/fault_server.json" 2> "$O/fault_server.log" &
for _ in $(seq 300); do [ -e /tmp/mps_ready_b ] && break; sleep 0.1; done; sleep 1
# by command line: a process name is cut to 15 characters
SRV=$(pgrep -f nvidia-cuda-mps-server | head -1); echo "server pid=$SRV"; kill -9 "$SRV"; wait
echo "client under the killed server: rc=$?"; cat "$O/fault_server.json"; tail -3 "$O/fault_server.log"
"${KREX[@]}" status --json > "$O/status_after_server_kill.json" 2>&1
python3 -c "import json; print('mps after server kill:', json.load(open('$O/status_after_server_kill.json'))['daemon']['mps'])"
after_region after_server_kill
"${KREX[@]}" journal --json > "$O/journal_faults.json" 2>/dev/null
python3 - "$O/journal_faults.json" <<'EOF2'
import json, sys
try:
    recs = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"journal unreadable: {e}")
for r in recs[-6:]:
    print({k: r.get(k) for k in ("slot", "clean", "flags", "reasons", "duration_ms")})
EOF2

echo "== 5. krex daemon stop"
CPID=$(python3 -c "import json; print(json.load(open('$O/status.json'))['daemon']['mps']['gpus'][0]['pid'])")
timeout 60 "${KREX[@]}" daemon stop; echo "rc=$?"
for i in $(seq 60); do kill -0 "$CPID" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$CPID" 2>/dev/null; then echo "control daemon $CPID still running 30 s after"; else echo "control daemon $CPID gone after ~$((i / 2)) s"; fi
cp "$KREX_STATE_DIR/krexd.log" "$O/" 2>/dev/null; cp -r "$KREX_STATE_DIR/mps" "$O/mps-dirs" 2>/dev/null
ls "$PIPE" 2>&1 | head -3
[ "${MPS_CONTEXTS:-1}" = 0 ] && exit 0  # no context measurement: no table
echo "== table"
python3 - "$O" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1] + "/contexts.json"))
print("| processes at once | plain: ctx p50 / max s | MiB each | MPS: ctx p50 / max s | MiB each |")
print("|---|---|---|---|---|")
for n in (8, 16, 32):
    p = next(r for r in rows if r["mode"] == "plain" and r["n"] == n)
    m = next(r for r in rows if r["mode"] == "mps" and r["n"] == n)
    print(f"| {n} | {p['ctx_p50_s']} / {p['ctx_max_s']} ({p['ok']} ok) | {p['mib_per_process']} | "
          f"{m['ctx_p50_s']} / {m['ctx_max_s']} ({m['ok']} ok) | {m['mib_per_process']} |")
EOF
