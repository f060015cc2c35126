{{/* The three service containers. The preprocess one is shared by its own pods and co-located pods. */}}

{{- define "llmserve.gatewayContainer" -}}
{{- $v := .Values.gateway }}
- name: gateway
  image: {{ include "llmserve.image" (dict "root" . "image" $v.image) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [python, -m, llmserve.gateway]
  args:
    {{- include "llmserve.serverArgs" (dict "root" . "port" $v.port "metricsPort" .Values.metrics.port "drain" $v.drain) | nindent 4 }}
    # Every ready preprocess pod behind its headless Service: the gateway balances over them
    # (one ClusterIP would pin each gateway's one connection to one pod).
    - --preprocess
    - {{ printf "dns:///%s:%v" (include "llmserve.serviceHost" (dict "root" . "component" "preprocess")) .Values.preprocess.port }}
    # Every ready replica behind the headless Service, re-resolved as pods come and go.
    - --inference
    - {{ printf "dns:///%s:%v" (include "llmserve.serviceHost" (dict "root" . "component" "inference")) .Values.inference.port }}
    - --downstream-ready-timeout-s
    - {{ $v.downstreamReadyTimeoutSeconds | quote }}
    - --workers
    - {{ $v.workers | quote }}
    - --max-connection-age-s
    - {{ $v.maxConnectionAgeSeconds | quote }}
    {{- if $v.httpPort }}
    - --http-port
    - {{ $v.httpPort | quote }}
    {{- end }}
    - --routing
    - {{ $v.routing }}
    {{- if .Values.colocated.kvPull.enabled }}
    - --routing-kv-pull
    {{- end }}
    {{- if include "llmserve.hasRoutingRedis" . }}
    - --redis-url
    - $(LLMSERVE_ROUTING_REDIS_URL)
    {{- end }}
    {{- with $v.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- include "llmserve.env" (dict "root" .) | nindent 2 }}
  {{- include "llmserve.ports" (dict "grpcName" "grpc" "port" $v.port "metricsName" "metrics" "metricsPort" .Values.metrics.port "httpPort" $v.httpPort) | nindent 2 }}
  {{- include "llmserve.grpcProbes" (dict "port" $v.port "service" "llmserve.v1.GatewayService" "startupTimeoutSeconds" $v.startupTimeoutSeconds) | nindent 2 }}
  {{- include "llmserve.preStop" $v.drain | nindent 2 }}
  resources:
    {{- toYaml $v.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "llmserve.volumeMounts" . | nindent 4 }}
{{- end }}

{{/* Port names differ in a co-located pod, where inference's ports are "grpc" and "metrics". */}}
{{- define "llmserve.preprocessContainer" -}}
{{- $v := .Values.preprocess }}
{{- $metricsPort := include "llmserve.preprocessMetricsPort" . | int }}
- name: preprocess
  image: {{ include "llmserve.image" (dict "root" . "image" $v.image) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [python, -m, llmserve.preprocess]
  args:
    {{- include "llmserve.serverArgs" (dict "root" . "port" $v.port "metricsPort" $metricsPort "drain" $v.drain) | nindent 4 }}
    {{- include "llmserve.sharedArgs" . | nindent 4 }}
    {{- if include "llmserve.hasPromptCacheRedis" . }}
    - --redis-url
    - $(LLMSERVE_PROMPT_CACHE_REDIS_URL)
    {{- end }}
    {{- with $v.tokenizerThreads }}
    - --tokenizer-threads
    - {{ . | quote }}
    {{- end }}
    {{- with $v.promptCacheBytes }}
    - --prompt-cache-bytes
    - {{ . | quote }}
    {{- end }}
    {{- with $v.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- include "llmserve.env" (dict "root" .) | nindent 2 }}
  {{- $names := ternary (list "pre-grpc" "pre-metrics") (list "grpc" "metrics") .Values.colocated.enabled }}
  {{- include "llmserve.ports" (dict "grpcName" (index $names 0) "port" $v.port "metricsName" (index $names 1) "metricsPort" $metricsPort) | nindent 2 }}
  {{- include "llmserve.grpcProbes" (dict "port" $v.port "service" "llmserve.v1.PreprocessService" "startupTimeoutSeconds" $v.startupTimeoutSeconds) | nindent 2 }}
  {{- include "llmserve.preStop" $v.drain | nindent 2 }}
  resources:
    {{- toYaml $v.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "llmserve.volumeMounts" . | nindent 4 }}
    {{- if .Values.colocated.enabled }}
    - name: shm
      mountPath: /dev/shm
    {{- end }}
{{- end }}

{{- define "llmserve.inferenceContainer" -}}
{{- $v := .Values.inference }}
- name: inference
  image: {{ include "llmserve.image" (dict "root" . "image" $v.image) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [python, -m, llmserve.inference]
  args:
    {{- include "llmserve.serverArgs" (dict "root" . "port" $v.port "metricsPort" .Values.metrics.port "drain" $v.drain) | nindent 4 }}
    {{- include "llmserve.sharedArgs" . | nindent 4 }}
    # The pod name: a stable routing key for this replica's lifetime.
    - --replica-id
    - $(POD_NAME)
    - --backend
    - {{ $v.backend }}
    - --device
    - {{ $v.device }}
    {{- if gt (int $v.tensorParallel.size) 1 }}
    - --tensor-parallel-size
    - {{ $v.tensorParallel.size | quote }}
    {{- end }}
    {{- with $v.dtype }}
    - --dtype
    - {{ . }}
    {{- end }}
    {{- if include "llmserve.hasRoutingRedis" . }}
    - --redis-url
    - $(LLMSERVE_ROUTING_REDIS_URL)
    {{- end }}
    {{- if .Values.colocated.kvPull.enabled }}
    - --kv-pull
    {{- end }}
    {{- with $v.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- include "llmserve.env" (dict "root" . "podName" true) | nindent 2 }}
  {{- include "llmserve.ports" (dict "grpcName" "grpc" "port" $v.port "metricsName" "metrics" "metricsPort" .Values.metrics.port) | nindent 2 }}
  {{- include "llmserve.grpcProbes" (dict "port" $v.port "service" "llmserve.v1.InferenceService" "startupTimeoutSeconds" $v.startupTimeoutSeconds) | nindent 2 }}
  {{- include "llmserve.preStop" $v.drain | nindent 2 }}
  resources:
    {{- $resources := deepCopy $v.resources }}
    {{- if $v.gpus }}
    {{- $limits := merge (dict "nvidia.com/gpu" $v.gpus) ($resources.limits | default dict) }}
    {{- $_ := set $resources "limits" $limits }}
    {{- end }}
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "llmserve.volumeMounts" . | nindent 4 }}
    {{- if include "llmserve.inferenceShmSize" . }}
    - name: shm
      mountPath: /dev/shm
    {{- end }}
{{- end }}
