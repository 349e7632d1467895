#!/usr/bin/env bash
# `stormo bench` beside llama.cpp's `llama-bench` on this machine, on the same
# gpt-oss-20b-geometry checkpoint, alternated twice so both see the same minutes of a noisy host.
# llama.cpp is commit 0c1e570, the commit of the figures the speed issue quotes, taken from the
# llama-cpp-python 0.3.36 source package, fetched by pip (`pip download --no-binary`, never by
# address) and checked against the sha256 pinned below, by pip and again here. Not part of `.ci/run`:
# it downloads about 4 GB (PyTorch and friends, for llama.cpp's own checkpoint converter), needs
# about 35 GB of disk besides the checkpoint, and takes 30-40 minutes on 2 cores.
#
#   stormo synth --preset gpt-oss-20b --out /tmp/g20
#   bash .ci/llamacpp-side-by-side.sh /tmp/g20 exact          # BF16 GGUF vs stormo exact
#   bash .ci/llamacpp-side-by-side.sh /tmp/g20 int8-experts   # BF16 GGUF vs --int8-experts
#   bash .ci/llamacpp-side-by-side.sh /tmp/g20 both           # Q8_0 GGUF vs both opt-ins
#   bash .ci/llamacpp-side-by-side.sh /tmp/g20 int8-attn-head # Q8_0 GGUF vs --int8-attn-head
#   NO_AMX=1 bash .ci/llamacpp-side-by-side.sh ...            # on a VM without AMX state (below)
#   ENGINE=ik bash .ci/llamacpp-side-by-side.sh /tmp/g20 exact # ik_llama.cpp instead (below)
#
# Each run also draws both programs' figures as a chart, $WORK/side-by-side-MODE-RUN.svg
# (`stormo bench --svg FILE --svg-llama LLAMA_BENCH_JSON`; with ENGINE=ik,
# $WORK/side-by-side-ik-MODE-RUN.svg, `--svg-llama-name ik_llama.cpp`).
#
# ENGINE=ik runs ik_llama.cpp (the fork with repacked CPU kernels and fused MoE) instead of
# llama.cpp: the ik_llama.cpp that the ik-llama-cpp-python 0.1.5 source package vendors (it
# reads gpt-oss), fetched by pip and checked against its pinned sha256 like llama.cpp's, its
# `llama-bench` run with `-rtr 1` (its kernels' weights repacked at load) on the same GGUF,
# which llama.cpp's converter still makes (so llama-cpp-python's source package is fetched too).
# Its line in the summary begins with `ik_llama.cpp`. Its llama-bench is one of its examples (so
# they are configured; only llama-bench is built), and its flash-attention kernels are built for
# f16 and 8- and 6-bit K/V caches only (`GGML_IQK_FA_ALL_QUANTS=OFF`): llama-bench's cache is
# f16, and the 4-bit caches' kernels only lengthen the build.
#
# What llama.cpp computes in these layouts: its CPU MXFP4 kernel multiplies by activations
# rounded to 8-bit blocks (as `--int8-experts` does), and its BF16 kernel by activations rounded
# to bf16, so the BF16 GGUF sits between stormo's exact path and `--int8-experts`.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: llamacpp-side-by-side.sh MODEL_DIR [exact|int8-experts|int8-attn-head|both]}"
mode="${2:-exact}"
work="${WORK:-/tmp/stormo-llamacpp}"
case "${ENGINE:-llama.cpp}" in
  llama.cpp) engine=llama.cpp; tag=""; engine_flags=(); cmake_flags=(-DLLAMA_BUILD_EXAMPLES=OFF) ;;
  ik | ik_llama.cpp)
    engine=ik_llama.cpp; tag="ik-"; engine_flags=(-rtr 1)
    cmake_flags=(-DLLAMA_BUILD_EXAMPLES=ON -DGGML_IQK_FA_ALL_QUANTS=OFF) ;;
  *) echo "unknown ENGINE '$ENGINE': llama.cpp (the default) or ik" >&2; exit 2 ;;
esac
case "$mode" in
  exact) flags=(); outtype=bf16 ;;
  int8-experts) flags=(--int8-experts); outtype=bf16 ;;
  int8-attn-head) flags=(--int8-attn-head); outtype=q8_0 ;;
  both) flags=(--int8-attn-head --int8-experts); outtype=q8_0 ;;
  *) echo "unknown mode '$mode': exact, int8-experts, int8-attn-head or both" >&2; exit 2 ;;
esac
mkdir -p "$work"

# The venv first: pip needs cmake and scikit-build-core (llama-cpp-python's build backend) to
# read the source package's metadata when it downloads it.
if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install --quiet cmake ninja scikit-build-core torch numpy \
    'transformers==4.57.6' sentencepiece 'protobuf<5' safetensors
fi
export PATH="$work/venv/bin:$PATH"

# fetch PACKAGE VERSION SHA256: the package's source package, by pip (which checks the sha256),
# checked again here and unpacked in $work.
fetch() {
  local file="${1//-/_}-$2" tarball
  tarball="$work/$file.tar.gz"
  [ -d "$work/$file" ] && return
  if [ ! -f "$tarball" ]; then
    echo "$1==$2 --hash=sha256:$3" > "$work/$1.txt"
    pip download --quiet --no-deps --no-binary "$1" --no-build-isolation \
      --require-hashes -r "$work/$1.txt" -d "$work"
  fi
  echo "$3  $tarball" | sha256sum -c -
  tar xzf "$tarball" -C "$work"
}
version=0.3.36
fetch llama-cpp-python "$version" 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
convert="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ "$engine" = ik_llama.cpp ]; then
  fetch ik-llama-cpp-python 0.1.5 33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad
  src="$work/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp"
  # The source package leaves out the script its build runs to write common/build-info.cpp
  # (llama-bench links it): this one names the package, as it records no commit.
  gen="$src/common/cmake/build-info-gen-cpp.cmake"
  if [ ! -f "$gen" ]; then
    mkdir -p "$(dirname "$gen")"
    cat > "$gen" <<'CMAKE'
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "ik-llama-cpp-python-0.1.5")
set(BUILD_COMPILER "unknown")
set(BUILD_TARGET "unknown")
configure_file("${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in"
  "${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp")
CMAKE
  fi
else
  src="$convert"
fi

# NO_AMX=1 builds for the host's AVX-512 without AMX: a native build on a Xeon whose CPU lists
# AMX compiles llama.cpp's AMX kernels for Q8_0, and a VM that does not give its guests the AMX
# register state (the 2-vCPU Xeon VMs of the Performance section) kills it with SIGILL on the
# Q8_0 GGUF. The BF16 and MXFP4 kernels have no AMX path, so `exact` is unaffected.
if [ "${NO_AMX:-0}" = 1 ]; then
  build="$src/build-noamx"
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
    -DGGML_AVX512_BF16=ON)
else
  build="$src/build"
  isa=(-DGGML_NATIVE=ON)
fi
bench="$build/bin/llama-bench"
if [ ! -x "$bench" ]; then
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF "${cmake_flags[@]}"
  cmake --build "$build" --target llama-bench -j "$(nproc)"
fi

# llama.cpp's converter reads the vocabulary from the checkpoint directory.
[ -f "$model/tokenizer.json" ] || cp fixtures/o200k-harmony/tokenizer.json "$model/"
[ -f "$model/tokenizer_config.json" ] ||
  echo '{"tokenizer_class": "PreTrainedTokenizerFast"}' > "$model/tokenizer_config.json"
gguf="$work/model-$outtype.gguf"
if [ ! -f "$gguf" ]; then
  PYTHONPATH="$convert/gguf-py" python "$convert/convert_hf_to_gguf.py" "$model" \
    --outfile "$gguf.partial" --outtype "$outtype"
  mv "$gguf.partial" "$gguf"
fi

cargo build --release --quiet
stormo="${CARGO_TARGET_DIR:-target}/release/stormo"
for i in 1 2; do
  echo "${tag}llama-bench run $i..." >&2
  /usr/bin/time -v "$bench" -m "$gguf" -t 2 -p 64,128 -n 32 -r 3 "${engine_flags[@]}" -o json \
    > "$work/${tag}llama-$mode-$i.json" 2> "$work/${tag}llama-$mode-$i.time"
  echo "stormo run $i..." >&2
  "$stormo" bench --model "$model" --warm --expert-cache 10GiB --no-hot-store \
    --disk-test 0 --prompt-tokens 64,128 --decode-tokens 32 "${flags[@]}" --json \
    --svg "$work/side-by-side-$tag$mode-$i.svg" --svg-llama "$work/${tag}llama-$mode-$i.json" \
    --svg-llama-name "$engine" > "$work/${tag}stormo-$mode-$i.json"
done

python3 - "$work" "$mode" "$tag" "$engine" <<'EOF'
import json, re, sys
work, mode, tag, engine = sys.argv[1:5]
name = "llama" if engine == "llama.cpp" else engine
w = max(len(name), len("stormo")) + 2
for i in (1, 2):
    s = json.load(open(f"{work}/{tag}stormo-{mode}-{i}.json"))
    l = {(r["n_prompt"], r["n_gen"]): r for r in json.load(open(f"{work}/{tag}llama-{mode}-{i}.json"))}
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                    open(f"{work}/{tag}llama-{mode}-{i}.time").read())
    print(f"run {i}: memory {s['memory_bandwidth_gb_s']:.1f} GB/s")
    print(f"  {'stormo':<{w}}decode {s['decode']['tok_s']:.2f} tok/s, prefill 64 / 128 {s['prefill'][0]['tok_s']:.2f} / {s['prefill'][1]['tok_s']:.2f} tok/s, "
          f"peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB")
    print(f"  {name:<{w}}decode {l[(0, 32)]['avg_ts']:.2f} tok/s, prefill 64 / 128 {l[(64, 0)]['avg_ts']:.2f} / {l[(128, 0)]['avg_ts']:.2f} tok/s, "
          f"peak RSS {int(rss.group(1)) / 2**20:.2f} GiB" if rss else "")
EOF
