{{/*
Relations between values that values.schema.json cannot express; rendering fails with a message
naming the values. Called once, from configmap.yaml.
*/}}

{{- define "llmserve.checkDrain" -}}
{{- $d := .drain }}
{{- if not (lt (int $d.preStopSleepSeconds) (int $d.drainSeconds)) }}
{{- fail (printf "%s.drain: preStopSleepSeconds (%v) must be less than drainSeconds (%v)" .component $d.preStopSleepSeconds $d.drainSeconds) }}
{{- end }}
{{- if not (lt (add $d.preStopSleepSeconds $d.drainSeconds) (int $d.terminationGracePeriodSeconds)) }}
{{- fail (printf "%s.drain: terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds + drainSeconds (%v + %v): the preStop sleep runs inside the grace period, and the kubelet kills the container when it ends" .component $d.terminationGracePeriodSeconds $d.preStopSleepSeconds $d.drainSeconds) }}
{{- end }}
{{- end }}

{{- define "llmserve.checkValues" -}}
{{- range $component := list "gateway" "preprocess" "inference" }}
{{- include "llmserve.checkDrain" (dict "component" $component "drain" (index $.Values $component).drain) }}
{{- end }}
{{- if .Values.colocated.enabled }}
{{- $pre := .Values.preprocess.drain }}
{{- $pod := .Values.inference.drain.terminationGracePeriodSeconds }}
{{- if not (lt (add $pre.preStopSleepSeconds $pre.drainSeconds) (int $pod)) }}
{{- fail (printf "colocated: preprocess.drain preStopSleepSeconds + drainSeconds (%v + %v) must be less than the pod's inference.drain.terminationGracePeriodSeconds (%v)" $pre.preStopSleepSeconds $pre.drainSeconds $pod) }}
{{- end }}
{{- end }}
{{- if and .Values.colocated.kvPull.enabled (not .Values.colocated.enabled) }}
{{- fail "colocated.kvPull needs colocated.enabled: the replicas pull from each other on one node" }}
{{- end }}
{{- if and .Values.colocated.kvPull.enabled (ne .Values.gateway.routing "kv") }}
{{- fail (printf "colocated.kvPull needs gateway.routing kv (it is %s): the kv router is what sends pull hints" .Values.gateway.routing) }}
{{- end }}
{{- if not (gt (int .Values.gateway.startupTimeoutSeconds) (int .Values.gateway.downstreamReadyTimeoutSeconds)) }}
{{- fail (printf "gateway.startupTimeoutSeconds (%v) must exceed gateway.downstreamReadyTimeoutSeconds (%v): the gateway binds its port only once preprocess and inference serve" .Values.gateway.startupTimeoutSeconds .Values.gateway.downstreamReadyTimeoutSeconds) }}
{{- end }}
{{- $last := 0 }}
{{- range .Values.shared.buckets }}
{{- if not (gt (int .) $last) }}
{{- fail (printf "shared.buckets must be strictly increasing: %v" $.Values.shared.buckets) }}
{{- end }}
{{- $last = int . }}
{{- end }}
{{- $volume := .Values.model.volume }}
{{- if and (eq $volume.type "emptyDir") (not .Values.model.fetch.enabled) }}
{{- fail "model.volume.type emptyDir starts empty: enable model.fetch, or use a pvc or hostPath that holds the checkpoint" }}
{{- end }}
{{- if and (eq $volume.type "pvc") (not $volume.pvc.claimName) }}
{{- fail "model.volume.type pvc needs model.volume.pvc.claimName" }}
{{- end }}
{{- if and (eq $volume.type "hostPath") (not $volume.hostPath.path) }}
{{- fail "model.volume.type hostPath needs model.volume.hostPath.path" }}
{{- end }}
{{- if .Values.gateway.apiKeys.enabled }}
{{- fail "gateway.apiKeys is not wired: the gateway has no API-key authentication yet, so keys from a Secret would be ignored. Keep it disabled and put authentication in front of the gateway." }}
{{- end }}
{{- $external := .Values.redis.external }}
{{- if and (eq .Values.redis.mode "external") (not (or $external.routingUrl $external.existingSecret)) }}
{{- fail "redis.mode external needs redis.external.routingUrl or redis.external.existingSecret" }}
{{- end }}
{{- if and .Values.inference.gpus (eq .Values.inference.device "cpu") }}
{{- fail (printf "inference.gpus is %v but inference.device is cpu: set gpus 0 on CPU, or device cuda" .Values.inference.gpus) }}
{{- end }}
{{- if and (not .Values.inference.gpus) (hasPrefix "cuda" .Values.inference.device) }}
{{- fail (printf "inference.device is %s but inference.gpus is 0: no GPU would be allocated" .Values.inference.device) }}
{{- end }}
{{- $tp := int .Values.inference.tensorParallel.size }}
{{- if gt $tp 1 }}
{{- if ne .Values.inference.backend "torch" }}
{{- fail (printf "inference.tensorParallel.size %d needs inference.backend torch, not %s" $tp .Values.inference.backend) }}
{{- end }}
{{- if hasPrefix "cuda:" .Values.inference.device }}
{{- fail (printf "inference.tensorParallel.size %d needs inference.device cuda (rank r runs on GPU r of the pod), not %s" $tp .Values.inference.device) }}
{{- end }}
{{- if and (hasPrefix "cuda" .Values.inference.device) (ne (int .Values.inference.gpus) $tp) }}
{{- fail (printf "inference.gpus (%v) must equal inference.tensorParallel.size (%d): rank r runs on GPU r of the pod" .Values.inference.gpus $tp) }}
{{- end }}
{{- if .Values.colocated.kvPull.enabled }}
{{- fail (printf "inference.tensorParallel.size %d cannot be used with colocated.kvPull: a pull would copy rank 0's KV heads only" $tp) }}
{{- end }}
{{- end }}
{{- end }}
