#!/usr/bin/env bash
# Streams a chat completion with `curl -N` from a running `kvq serve` and checks the raw SSE
# lines: every event is `data: <json>` followed by a blank line, the first delta carries the
# role, one chunk carries the finish_reason, and the stream ends with `data: [DONE]`.
# Usage: curl_sse.sh BASE_URL
set -euo pipefail
# Every exit says why: a failing command under `set -e` would otherwise end the script silently.
trap 'rc=$?; echo "FAIL: line $LINENO: \"$BASH_COMMAND\" exited with $rc"' ERR
base="$1"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
curl -sS -N --fail-with-body "$base/v1/chat/completions" \
  -H 'content-type: application/json' -H 'x-kv-cache-method: fp16' \
  -d '{"messages":[{"role":"user","content":"Say hello."}],"stream":true,"max_tokens":12,"temperature":0}' \
  -D "$out.headers" >"$out"
fail() { echo "FAIL: $*"; echo "--- stream:"; cat "$out"; exit 1; }
grep -qi '^content-type: text/event-stream' "$out.headers" || fail "content-type is not text/event-stream"
grep -qi '^x-kv-cache-method: fp16' "$out.headers" || fail "x-kv-cache-method header missing"
rm -f "$out.headers"
# Every non-empty line is a data line; events are separated by blank lines.
bad=$(grep -v '^$' "$out" | grep -cv '^data: ' || true)
[ "$bad" -eq 0 ] || fail "$bad lines are not 'data: ' lines"
[ "$(grep -v '^$' "$out" | tail -n1)" = "data: [DONE]" ] || fail "the stream does not end with data: [DONE]"
data=$(grep '^data: {' "$out" | sed 's/^data: //')
# Here-strings, not `echo | head`: head closing the pipe early must not fail the pipeline.
first=$(head -n1 <<<"$data")
python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["object"]=="chat.completion.chunk"; assert d["choices"][0]["delta"]["role"]=="assistant"' \
  <<<"$first" || fail "first chunk does not carry the assistant role"
finishes=$(python3 -c 'import json,sys; print(sum(1 for l in sys.stdin if json.loads(l)["choices"] and json.loads(l)["choices"][0]["finish_reason"]))' <<<"$data")
[ "$finishes" -eq 1 ] || fail "expected one finish_reason chunk, got $finishes"
# Events are separated by exactly one blank line.
awk 'NF==0{blank++; next} {if (NR>1 && blank!=1) exit 1; blank=0}' "$out" || fail "events are not separated by single blank lines"
echo "curl SSE stream ok ($(wc -l <<<"$data") chunks)"
