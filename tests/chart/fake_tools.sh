#!/bin/bash
# Stand-in for docker, kind, kubectl, helm, curl and sleep, so tests can run e2e/run.sh's control
# flow without a cluster. Linked under each tool's name; logs "TOOL ARGS..." to $FAKE_LOG.
# The Deployment's replica count follows the script's load: 1, then 2 once the load pod runs,
# then 1 once it is deleted. FAKE_DOCKER_DOWN=1: the engine does not answer. FAKE_NO_SCALE=1:
# the count never rises. FAKE_LEFTOVER=1: a CRD is still there after the uninstall.
tool=${0##*/}
args="$*"
printf '%s %s\n' "$tool" "$args" >>"$FAKE_LOG"

case $tool in
sleep | helm | kind) exit 0 ;;
docker)
    [[ $1 == info && ${FAKE_DOCKER_DOWN:-0} == 1 ]] && exit 1
    exit 0
    ;;
curl)
    case $args in
    */v1/chat/completions*)
        echo '{"choices": [{"message": {"role": "assistant", "content": "red"}}]}' ;;
    */metrics*) echo 'slipstream:num_requests_waiting{model_name="chat-small"} 0.0' ;;
    esac
    exit 0
    ;;
kubectl)
    [[ $args == *"-f -"* ]] && cat >/dev/null  # read the piped manifest, as kubectl does
    case $args in
    *"patch --local"*) echo "kind: InferenceService" ;;
    *"jsonpath={.spec.replicas}"*)
        if [[ ${FAKE_NO_SCALE:-0} != 1 ]] && grep -q "run e2e-load" "$FAKE_LOG" \
            && ! grep -q "delete pod e2e-load" "$FAKE_LOG"; then
            echo 2
        else
            echo 1
        fi
        ;;
    *"get crd --no-headers"*)
        [[ ${FAKE_LEFTOVER:-0} == 1 ]] && echo "inferenceservices.slipstream.dev   2024-01-01" ;;
    esac
    exit 0
    ;;
esac
echo "fake_tools.sh: unknown tool $tool" >&2
exit 2
