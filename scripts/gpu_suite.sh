#!/usr/bin/env bash
# The GPU suite in one device call.
#
#   here (has pip and the registry):  [BASE=<git rev>] bash scripts/gpu_suite.sh prepare
#       -> .whl/: llmserve itself plus the packages the GPU box lacks (structlog, trio, xgrammar, aiohttp and their needs);
#          with BASE, also .whl/base/: llmserve at that revision, for `run ab`
#   on the GPU box (device tool, carry [".whl"]):
#       bash scripts/gpu_suite.sh run [w-small|w-large|w-serve|quant-1|quant-2|figures|peers|none|script ...|ab ...|ab-script ...]
#       -> installs .whl into /tmp/site, runs the GPU and kernel tests (SKIP_TESTS=1: not; TESTS_PART=1|2|3:
#          a third of them, as one call no longer holds them all), then the
#          benchmark (BENCH_ARGS replaces "--peer hf"; PROFILE=1 adds profiler windows; COLD=1: an
#          empty Triton cache, as on a fresh machine)
#          (w-serve: the server plus `llmserve bench serve` at rate inf and at half the max,
#          DETOKENIZE=1: with a tokenizer in the model's directory; every bench serve reads the
#          streams through CLIENT_PROCS (4) client processes, the working tree's client also in ab-serve;
#          quant-1: int8 kernel sweep, batch-1 decode bf16 vs int8, quantization quality;
#          quant-2: decode attention bf16 vs FP8 cache, W-small with a bf16 vs FP8 KV cache,
#          W-large bf16 vs fp8;
#          ab WORKLOAD: the working tree's llmserve and BASE's alternately, AB_RUNS (4) runs in all,
#          the new side first (AB_FIRST=base: the base side), the same box and call: compare
#          commits only this way, boxes of one kind differ by ~4%;
#          ab-serve: W-serve at rate inf the same way, AB_RUNS (2) rounds, with the engine process
#          and on one loop;
#          moe: the fused-MoE kernel (scripts/moe_bench.py), W-small's and W-large's requests on
#          the Qwen3-30B-A3B shape;
#          w-prefix: W-prefix with prefix caching off, on, on + cascade attention, then
#          scripts/cascade_bench.py (the kernel in FlashInfer's setting, the cost model's sweep);
#          multi: several GPUs (tensor parallelism, replicas; MULTI_PARTS picks the parts);
#          pair: speculative decoding's trained pair (needs `CORPUS=1 prepare`: .whl/corpus.txt):
#          the target (--size target, 10% copy rows) and its draft distilled from it, trained on
#          the box, then spec_bench's pair mode at each k of PAIR_K ("4 6"; PAIR_CASES: a subset of
#          its cases); the logs and JSON also in $OUT/pair.tgz (a call returns only so many files);
#          e.g. `CORPUS=1 bash scripts/gpu_suite.sh prepare`, then `TESTS_PART=spec ... run pair`;
#          figures: decode-b1 bf16 and int8, W-small with an FP8 cache and W-large fp8 beside bf16,
#          the server's start-up (BENCHMARKS.md's figures without a peer);
#          peers: W-small and W-large (PEER_WORKLOADS) with vLLM 0.24.0 as the peer in the same
#          call (`SLIM=1 prepare` here, carry [".whl", ".peers"]);
#          script SCRIPT ARGS...: scripts/SCRIPT with the working tree's llmserve (--json into $OUT),
#          e.g. `script gated_gemm_bench.py --ms 8192`;
#          ab-script SCRIPT ARGS...: scripts/SCRIPT (the working tree's) against each side's
#          llmserve in turn, e.g. `ab-script attention_bench.py --prefill`: kernels of two commits);
#          logs and JSON results under $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

case "${1:-}" in
prepare)
    rm -rf .whl && mkdir -p .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl structlog==26.1.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 \
        quart==0.22.0 hypercorn==0.18.0 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0 wsproto==1.3.2 h2==4.4.1 \
        priority==2.0.0 hpack==4.2.0 hyperframe==6.1.0 pydantic==2.14.3 pydantic_core==2.50.4 \
        annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
        xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
        referencing==0.37.0 rpds-py==2026.9.1 \
        aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 \
        yarl==1.25.1
    "$PY" -m pip wheel -q --no-deps -w .whl .
    if [ -n "${SLIM:-}" ]; then  # for `run peers`: the tree, .whl and .peers must stay under 64 MiB
        rm -f .whl/llmserve-*.whl .whl/xgrammar-* .whl/apache_tvm_ffi-* .whl/jsonschema* .whl/referencing-* .whl/rpds_py-*
        src=$(mktemp -d)
        tar --exclude=./.git --exclude=./.venv --exclude=./.venv-ci --exclude=./.whl --exclude=./.peers \
            --exclude=./build --exclude='./*.egg-info' --exclude='*/builtin_model/model.safetensors' -cf - . \
            | tar -x -C "$src"
        "$PY" -m pip wheel -q --no-deps -w .whl "$src"
        rm -rf "$src"
    fi
    if [ -n "${BASE:-}" ]; then
        base_src=$(mktemp -d)
        git archive "$BASE" | tar -x -C "$base_src"
        "$PY" -m pip wheel -q --no-deps -w .whl/base "$base_src"
        rm -rf "$base_src"
        git rev-parse --short "$BASE" > .whl/base/REVISION
    fi
    if [ -n "${CORPUS:-}" ]; then  # for `run pair`: the training text (Debian's python3.11-doc, ~8 MB)
        docs=$(mktemp -d)
        (cd "$docs" && apt-get download -q python3.11-doc >/dev/null && dpkg -x python3.11-doc_*.deb root)
        "$PY" scripts/train_builtin_model.py corpus "$docs/root/usr/share/doc/python3.11/html/_sources" .whl/corpus.txt
        rm -rf "$docs"
    fi
    ls -la .whl .whl/base 2>/dev/null
    ;;
run)
    OUT=${OUT:-/tmp/llmserve-gpu-out}
    mkdir -p "$OUT"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    CLIENTS=${CLIENT_PROCS:-4}  # bench serve's client processes: one may read fewer chunks than a server sends
    { nvidia-smi; "$PY" -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'; } \
        > "$OUT/env.txt" 2>&1
    set +e
    # The GPU tests take longer than one call allows: TESTS_PART=1 runs the engine's GPU tests but the
    # float32 equivalence of Gemma and the mixtures of experts, 2 those, the MoE kernel's and the
    # sampling kernels' tests, 3 the attention and matmul kernels' and cascade's, spec speculative
    # decoding's; unset: all.
    part=()
    case "${TESTS_PART:-}" in
        1) part=(-k "test_gpu and not (float32 and (gemma or moe or mixtral))") ;;
        2) part=(-k "test_moe or test_sampling_kernels or (test_gpu and float32 and (gemma or moe or mixtral))") ;;
        3) part=(-k "test_kernels or test_cascade") ;;
        spec) part=(-k "(test_gpu and (specul or draft)) or check_drafts") ;;  # speculative decoding's (with `run pair`)
    esac
    [ -n "${SKIP_TESTS:-}" ] || timeout ${TEST_TIMEOUT:-480} "$PY" -m pytest -q -p no:cacheprovider --timeout 120 --durations 12 -rf "${part[@]}" tests/test_gpu.py tests/test_kernels.py tests/test_sampling_kernels.py tests/test_cascade.py tests/test_moe.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    # COLD=1: the benchmark starts on an empty Triton cache (a fresh machine's start-up: every kernel compiled)
    [ -z "${COLD:-}" ] || export TRITON_CACHE_DIR="$(mktemp -d)"
    bench=${2:-w-small}
    if [ "$bench" = w-serve ]; then
        # W-serve: the server on W-small's model shape (dummy weights), driven over HTTP streaming
        # by a separate client process at rate inf, then at half the throughput that reached; the
        # offline W-small first (the figure W-serve is a fraction of), and the server with its
        # engine on the same event loop (server.engine_process = false) at rate inf for comparison.
        timeout 150 "$PY" -m llmserve.bench.throughput --workload w-small --json "$OUT/w-small.json" > "$OUT/w-small.log" 2>&1
        grep -E '"(wall_s|output_tok_s|roofline_fraction)"' "$OUT/w-small.json"
        # DETOKENIZE=1: a tokenizer of the model's whole vocabulary in its directory, as a real
        # checkpoint has: the server streams text (detokenized in its own process)
        "$PY" -c 'import os; from llmserve.bench.workloads import w_small; w = w_small(); d = w.write_model_dir("/tmp/w-small-model"); os.environ.get("DETOKENIZE") and w.write_tokenizer(d)'
        serve_bench() {  # engine_process (true|false), then the rates to run, in order ("half": half of the first)
            local proc=$1; shift
            printf '[model]\nmodel = "/tmp/w-small-model"\nload_format = "dummy"\n[scheduler]\nlog_interval_s = 10.0\n[server]\nport = 8000\nmax_waiting_requests = 100000\nengine_process = %s\n' "$proc" > /tmp/w-serve.toml
            "$PY" -m llmserve.cli --config /tmp/w-serve.toml > "$OUT/w-serve-server-$proc.log" 2>&1 &
            local server=$!
            for _ in $(seq 1 120); do curl -sf localhost:8000/health >/dev/null && break; sleep 1; done
            local first="" rate
            for rate in "$@"; do
                [ "$rate" = half ] && rate=$("$PY" -c "import json; print(json.load(open('$first'))['request_throughput'] / 2)")
                "$PY" -m llmserve.cli bench serve --workload w-small --rate "$rate" --client-processes "$CLIENTS" \
                    --json "$OUT/w-serve-$proc-$rate.json"
                first=${first:-$OUT/w-serve-$proc-$rate.json}
            done
            kill -TERM $server; wait $server
            tail -3 "$OUT/w-serve-server-$proc.log"
        }
        serve_bench true inf half
        serve_bench false inf
    elif [ "$bench" = ab ]; then
        # The working tree (new) and BASE (base) alternately on one box: base's llmserve shadows
        # the new one on its PYTHONPATH, the other packages are shared.
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base .whl/base/*.whl
        w=${3:-w-small}
        first=$([ "${AB_FIRST:-new}" = base ] && echo 0 || echo 1)  # AB_FIRST=base: base runs first
        for i in $(seq 1 "${AB_RUNS:-4}"); do
            if [ $((i % 2)) = "$first" ]; then side=new site=/tmp/site; else side=base site=/tmp/site-base:/tmp/site; fi
            echo "$side run $i from $(date +%T)"
            PYTHONPATH=$site timeout 200 "$PY" -m llmserve.bench.throughput --workload "$w" ${BENCH_ARGS:-} \
                --json "$OUT/$w-$side-$i.json" > "$OUT/$w-$side-$i.log" 2>&1
            echo "$side to $(date +%T):"; "$PY" scripts/bench_summary.py "$OUT/$w-$side-$i.json"
        done
    elif [ "$bench" = ab-serve ]; then
        # W-serve at rate inf, the working tree's server and BASE's alternately, AB_RUNS (2) rounds,
        # each with its engine process (engine_process = true) and on one loop (false; AB_PROCS=true:
        # the engine process only; AB_ORDER="base new": base first in each round).
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base .whl/base/*.whl
        "$PY" -c 'from llmserve.bench.workloads import w_small; w_small().write_model_dir("/tmp/w-small-model")'
        for i in $(seq 1 "${AB_RUNS:-2}"); do for proc in ${AB_PROCS:-true false}; do for side in ${AB_ORDER:-new base}; do
            if [ $side = new ]; then site=/tmp/site; else site=/tmp/site-base:/tmp/site; fi
            printf '[model]\nmodel = "/tmp/w-small-model"\nload_format = "dummy"\n[scheduler]\nlog_interval_s = 0\n[server]\nport = 8000\nmax_waiting_requests = 100000\nengine_process = %s\n' "$proc" > /tmp/w-serve.toml
            PYTHONPATH=$site "$PY" -m llmserve.cli --config /tmp/w-serve.toml > "$OUT/w-serve-server-$side-$proc-$i.log" 2>&1 &
            server=$!
            for _ in $(seq 1 120); do curl -sf localhost:8000/health >/dev/null && break; sleep 1; done
            echo "$side engine_process=$proc run $i:"
            # (the client is the working tree's for both sides: only the server is compared)
            "$PY" -m llmserve.cli bench serve --workload w-small --rate inf --client-processes "$CLIENTS" \
                --json "$OUT/w-serve-$side-$proc-$i.json" | grep -E "output tok/s|tpot_ms|itl_ms"
            kill -TERM $server; wait $server
        done; done; done
    elif [ "$bench" = peers ]; then
        # Each workload (PEER_WORKLOADS) through our engine, then through vLLM 0.24.0 in a process of
        # its own (llmserve.bench.vllm_peer), one call: carry [".whl", ".peers"] from `SLIM=1 prepare`
        # (.peers/vllm/vsite.tar.xz: ../shared/peers/vllm/README.md says how it is built).
        mkdir -p /tmp/vsite
        xz -T0 -dc .peers/vllm/vsite.tar.xz | tar -x -C /tmp/vsite
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite \
            .whl/pydantic-*.whl .whl/pydantic_core-*.whl .whl/annotated_types-*.whl \
            .whl/typing_inspection-*.whl .whl/typing_extensions-*.whl .whl/sniffio-*.whl
        export LLMSERVE_VLLM_SITE=/tmp/vsite
        for w in ${PEER_WORKLOADS:-w-small w-large}; do
            if [ "$w" = w-large ]; then t=300; else t=230; fi
            timeout $t "$PY" -m llmserve.bench.throughput --workload "$w" --peer vllm --vllm-timeout $((t - 75)) \
                ${BENCH_ARGS:-} --json "$OUT/$w-vllm.json" > "$OUT/$w-vllm.log" 2>&1
            echo "$w: exit $?"; grep -E '^peer ' "$OUT/$w-vllm.log"
            [ -f "$OUT/$w-vllm.json" ] && "$PY" scripts/bench_summary.py "$OUT/$w-vllm.json"
        done
    elif [ "$bench" = figures ]; then
        # BENCHMARKS.md's figures that have no peer: decode-b1 bf16 and int8, the quantized variants
        # beside bf16 in the same call, the server's start-up (a cold run, then a warm one).
        for run in decode-b1:none decode-b1:int8 w-small:none w-small:fp8kv w-large:none w-large:fp8; do
            w=${run%%:*} v=${run#*:}
            args=(--workload "$w" --json "$OUT/$w-$v.json")
            case $v in fp8kv) args+=(--kv-cache-dtype fp8);; int8|fp8) args+=(--quantization "$v");; esac
            timeout 150 "$PY" -m llmserve.bench.throughput "${args[@]}" > "$OUT/$w-$v.log" 2>&1
            echo "$w $v: exit $?"; "$PY" scripts/bench_summary.py "$OUT/$w-$v.json"
        done
        timeout 150 "$PY" scripts/startup_bench.py --runs 2 --cold --json "$OUT/startup.json" 2>&1 | tail -4
    elif [ "$bench" = w-prefix ]; then
        # W-prefix with prefix caching off, on, and on with cascade attention (auto), in one call;
        # then cascade against the plain decode kernel in FlashInfer's setting, and the cost
        # model's sweep (CASCADE_MODES: "sweep", also "tune", or "").
        for run in off:--no-prefix-caching:never on::never cascade::auto; do
            name=${run%%:*} rest=${run#*:}; flag=${rest%%:*} cascade=${rest#*:}
            timeout 200 "$PY" -m llmserve.bench.throughput --workload w-prefix $flag --cascade-attention "$cascade" \
                ${BENCH_ARGS:-} --json "$OUT/w-prefix-$name.json" > "$OUT/w-prefix-$name.log" 2>&1
            echo "w-prefix $name: exit $?"; "$PY" scripts/bench_summary.py "$OUT/w-prefix-$name.json"
        done
        (cd scripts && PYTHONPATH=/tmp/site:. timeout 200 "$PY" cascade_bench.py --json "$OUT/cascade-kernel.json") \
            > "$OUT/cascade-kernel.log" 2>&1; tail -3 "$OUT/cascade-kernel.log"
        for mode in ${CASCADE_MODES-sweep}; do  # sweep: the cost model's; tune: the prefix kernel's tiles
            (cd scripts && PYTHONPATH=/tmp/site:. timeout 300 "$PY" cascade_bench.py --$mode \
                --json "$OUT/cascade-$mode.json") > "$OUT/cascade-$mode.log" 2>&1
        done
    elif [ "$bench" = multi ]; then
        # Several GPUs (tensor parallelism and replicas), MULTI_PARTS of: tests (tests/test_gpu_multi.py),
        # collectives (scripts/allreduce_bench.py: a TP step's NCCL collectives, graphed), decode
        # (decode-b1 on the 8B shape at TP = 1, 2 and 4 where there are 4 GPUs), large (the
        # Llama-3.1-70B shape, dummy weights, served at TP = 2 and answering bench serve), serve-8b
        # (W-large's requests through the server: TP = 1 on one GPU, 2 replicas, TP = 2), w-large
        # (offline at TP = 1, 2 and 4 where there are 4 GPUs), serve-small (W-serve on W-small's shape: 1 replica, then 2).
        # NVLink multicast stays off in every process (they inherit this environment).
        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
        gpus=$(nvidia-smi -L | wc -l)
        gib=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')
        echo "$gpus GPUs of $gib GiB"
        serve_run() {  # name, model dir, timeout, serve flags..., then -- and bench serve's flags
            local name=$1 dir=$2 limit=$3; shift 3
            local flags=(); while [ "$1" != -- ]; do flags+=("$1"); shift; done; shift
            local t0=$SECONDS
            "$PY" -m llmserve.cli serve "$dir" --load-format dummy --log-interval-s 10 --port 8000 \
                --max-waiting-requests 100000 "${flags[@]}" > "$OUT/$name-server.log" 2>&1 &
            local server=$!
            for _ in $(seq 1 "$limit"); do curl -sf localhost:8000/health >/dev/null && break; sleep 1
                kill -0 $server 2>/dev/null || break; done
            echo "$name: up after $((SECONDS - t0)) s"
            timeout "$limit" "$PY" -m llmserve.cli bench serve --client-processes "$CLIENTS" "$@" --json "$OUT/$name.json" \
                | grep -E "throughput|tok/s|tpot_ms|ttft_ms|completed|failed"
            nvidia-smi --query-gpu=index,memory.used --format=csv,noheader > "$OUT/$name-memory.csv"
            kill -TERM $server; wait $server; tail -2 "$OUT/$name-server.log"
            gpus_free "$name"
        }
        gpus_free() {  # wait until no process holds a GPU (a rank that outlived its server would)
            local t0=$SECONDS
            while [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && [ $((SECONDS - t0)) -lt 60 ]; do
                sleep 1; done
            echo "$1: GPUs free $((SECONDS - t0)) s after exit; left: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
        }
        "$PY" -c 'from llmserve.bench.workloads import w_large, w_small; w_large().write_model_dir("/tmp/w-large-model"); w_small().write_model_dir("/tmp/w-small-model")'
        for part in ${MULTI_PARTS:-tests collectives decode large serve-8b w-large serve-small}; do
            echo "== $part from $(date +%T)"
            case $part in
            tests)
                timeout ${TEST_TIMEOUT:-420} "$PY" -m pytest -q -p no:cacheprovider --timeout 200 --durations 8 -rfs \
                    ${MULTI_TESTS:+-k "$MULTI_TESTS"} tests/test_gpu_multi.py 2>&1 | tee "$OUT/gpu_multi_tests.log" | tail -15 ;;
            collectives)
                for ranks in ${COLLECTIVE_RANKS:-2 4}; do [ "$ranks" -le "$gpus" ] || continue
                    (cd scripts && PYTHONPATH=/tmp/site:. timeout 120 "$PY" allreduce_bench.py --ranks $ranks \
                        --json "$OUT/allreduce-tp$ranks.json") 2>&1 | tail -4; done ;;
            decode)  # tp2-nccl: every all-reduce through NCCL (no one-shot kernel)
                for run in tp1 tp2 tp2-nccl tp4 tp4-nccl; do tp=${run:2:1}; [ "$tp" -le "$gpus" ] || continue
                    flags=(); [ "${run#*-}" = nccl ] && flags=(--disable-custom-all-reduce)
                    timeout 150 "$PY" -m llmserve.bench.throughput --workload decode-b1 --tensor-parallel-size $tp \
                        "${flags[@]}" --json "$OUT/decode-b1-$run.json" > "$OUT/decode-b1-$run.log" 2>&1
                    echo "decode-b1 $run: exit $?"; "$PY" scripts/bench_summary.py "$OUT/decode-b1-$run.json"
                    gpus_free decode-b1-$run; done ;;
            large)
                "$PY" -c 'import json, pathlib; from llmserve.bench.workloads import LLAMA31_70B as c; d = pathlib.Path("/tmp/llama-70b"); d.mkdir(exist_ok=True); (d / "config.json").write_text(json.dumps(c))'
                serve_run large-70b-tp2 /tmp/llama-70b 300 --tensor-parallel-size 2 --gpu-memory-utilization 0.95 \
                    --max-model-len 8192 -- --workload random --num-requests 64 --random-input-len 512 --random-output-len 128 ;;
            serve-8b)
                for run in ${SERVE_8B:-tp1:1:1 dp2:1:2 tp2:2:1}; do IFS=: read -r name tp dp <<< "$run"
                    serve_run serve-8b-$name /tmp/w-large-model 240 --tensor-parallel-size $tp --data-parallel-size $dp \
                        -- --workload w-large --rate inf; done ;;
            w-large)
                for tp in 1 2 4; do [ "$tp" -le "$gpus" ] || continue
                    timeout 200 "$PY" -m llmserve.bench.throughput --workload w-large --tensor-parallel-size $tp \
                        --json "$OUT/w-large-tp$tp.json" > "$OUT/w-large-tp$tp.log" 2>&1
                    echo "w-large tp$tp: exit $?"; "$PY" scripts/bench_summary.py "$OUT/w-large-tp$tp.json"
                    gpus_free w-large-tp$tp; done ;;
            serve-small)
                for dp in 1 2; do serve_run serve-small-dp$dp /tmp/w-small-model 150 --data-parallel-size $dp \
                    -- --workload w-small --rate inf; done ;;
            esac
        done
    elif [ "$bench" = moe ]; then
        # One MoE layer of the Qwen3-30B-A3B shape: the fused kernel against a per-expert loop and
        # transformers' experts (scripts/moe_bench.py; MOE_TUNE=1: its tile sweep too); then W-small's
        # and W-large's requests on that shape (MOE_WORKLOADS: workload:routing, LLMSERVE_MOE_ROUTING
        # uniform as a trained model routes, or model: the random router's), W-large's with the
        # random router beside transformers generate on its first 32 requests.
        (cd scripts && PYTHONPATH=/tmp/site:. timeout 150 "$PY" moe_bench.py --json "$OUT/moe-kernel.json") \
            > "$OUT/moe-kernel.log" 2>&1; tail -10 "$OUT/moe-kernel.log"
        [ -z "${MOE_TUNE:-}" ] || (cd scripts && PYTHONPATH=/tmp/site:. timeout 200 "$PY" moe_bench.py --tune \
            --json "$OUT/moe-tune.json" 2>&1 | tee "$OUT/moe-tune.log" | tail -10)
        for run in ${MOE_WORKLOADS:-w-small-moe:uniform w-small-moe:model w-large-moe:uniform w-large-moe:model}; do
            w=${run%:*} routing=${run#*:}
            peer=(); [ "$run" = w-large-moe:model ] && peer=(--peer hf --peer-requests 32)  # transformers routes by its router
            LLMSERVE_MOE_ROUTING=$routing timeout 280 "$PY" -m llmserve.bench.throughput --workload "$w" "${peer[@]}" \
                ${BENCH_ARGS:-} --json "$OUT/$w-$routing.json" > "$OUT/$w-$routing.log" 2>&1
            echo "$w $routing: exit $?"; "$PY" scripts/bench_summary.py "$OUT/$w-$routing.json"
        done
    elif [ "$bench" = pair ]; then
        # The pair as BENCHMARKS.md's speculative figures use it: a 139M target trained 500 steps
        # with 10% of its sequences repeating a passage (so n-gram proposals have text to copy), a
        # 5.8M draft distilled from it in 1,200; both ~1.5 minutes here, deterministic (seed 0).
        tok=(--tokenizer src/llmserve/builtin_model)
        timeout 200 "$PY" scripts/train_builtin_model.py train .whl/corpus.txt /tmp/pair-target "${tok[@]}" --size target \
            --steps 500 --copies 0.1 > "$OUT/train-target.log" 2>&1
        timeout 200 "$PY" scripts/train_builtin_model.py train .whl/corpus.txt /tmp/pair-draft "${tok[@]}" \
            --teacher /tmp/pair-target --steps 1200 > "$OUT/train-draft.log" 2>&1
        cp /tmp/pair-target/training.json "$OUT/target-training.json"
        cp /tmp/pair-draft/training.json "$OUT/draft-training.json"
        tail -n 1 "$OUT/train-target.log" "$OUT/train-draft.log"
        for k in ${PAIR_K:-4 6}; do
            (cd scripts && PYTHONPATH=/tmp/site:. timeout 240 "$PY" spec_bench.py --mode pair --target /tmp/pair-target \
                --draft /tmp/pair-draft --k "$k" ${PAIR_CASES:+--cases "$PAIR_CASES"} --json "$OUT/pair-k$k.json") \
                > "$OUT/pair-k$k.log" 2>&1
            echo "k = $k: exit $?"; grep -E '^(draft|target)' "$OUT/pair-k$k.log" | cut -c1-160
        done
        (cd "$OUT" && tar czf pair.tgz ./*.log ./*.json)
    elif [ "$bench" = script ]; then
        script=$3; shift 3
        (cd scripts && PYTHONPATH=/tmp/site:. timeout 500 "$PY" "$script" "$@" --json "$OUT/${script%.py}.json") \
            > "$OUT/${script%.py}.log" 2>&1
        tail -20 "$OUT/${script%.py}.log"
    elif [ "$bench" = ab-script ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base .whl/base/*.whl
        script=$3; shift 3
        for side in new base; do
            if [ $side = new ]; then site=/tmp/site; else site=/tmp/site-base:/tmp/site; fi
            echo "$side ($script $*):"
            (cd scripts && PYTHONPATH=$site:. timeout 280 "$PY" "$script" "$@" --json "$OUT/${script%.py}-$side.json") \
                > "$OUT/${script%.py}-$side.log" 2>&1
            tail -8 "$OUT/${script%.py}-$side.log"
        done
    elif [ "$bench" = quant-1 ]; then
        timeout 120 "$PY" scripts/int8_sweep.py --json "$OUT/int8-sweep.json" > "$OUT/int8-sweep.log" 2>&1
        tail -12 "$OUT/int8-sweep.log"
        for q in none int8; do
            args=(--workload decode-b1 --json "$OUT/decode-b1-$q.json")
            [ $q = none ] || args+=(--quantization $q)
            timeout 120 "$PY" -m llmserve.bench.throughput "${args[@]}" > "$OUT/decode-b1-$q.log" 2>&1
            grep -E '"(wall_s|output_tok_s|roofline_fraction|startup_s)"' "$OUT/decode-b1-$q.json"
        done
        timeout 240 "$PY" -m llmserve.bench.quality --json "$OUT/quality.json" > "$OUT/quality.log" 2>&1
        tail -60 "$OUT/quality.log"
    elif [ "$bench" = quant-2 ]; then
        timeout 100 "$PY" scripts/attention_bench.py --json "$OUT/attention-fp8.json" 2>&1 | tail -4
        for run in ${QUANT_RUNS:-w-small:none w-small:fp8kv w-large:none w-large:fp8}; do
            w=${run%:*} v=${run#*:}
            args=(--workload "$w" --json "$OUT/$w-$v.json")
            case $v in fp8kv) args+=(--kv-cache-dtype fp8 --profile "$OUT/$w-$v-profile");; fp8) args+=(--quantization fp8);; esac
            timeout 150 "$PY" -m llmserve.bench.throughput "${args[@]}" > "$OUT/$w-$v.log" 2>&1
            echo "$w $v"; grep -E '"(wall_s|output_tok_s|roofline_fraction|startup_s|preemptions|execute_ms|between_ms)"' "$OUT/$w-$v.json"
        done
    elif [ "$bench" != none ]; then
        # PROFILE=1: profiler windows (their export stalls the run for a moment: not for timings).
        timeout 330 "$PY" -m llmserve.bench.throughput --workload "$bench" ${BENCH_ARGS:---peer hf} \
            ${PROFILE:+--profile "$OUT/$bench-profile"} --json "$OUT/$bench.json" \
            > "$OUT/$bench.log" 2>&1
        tail -30 "$OUT/$bench.log"
    fi
    ;;
*)
    echo "usage: $0 prepare | run [w-small|w-large|w-serve|quant-1|quant-2|figures|pair|none | ab WORKLOAD | ab-serve | peers | script SCRIPT ARGS... | ab-script SCRIPT ARGS...]" >&2
    exit 2
    ;;
esac
