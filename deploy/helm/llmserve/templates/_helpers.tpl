{{/* Names, labels, images and the addresses the services find each other by. */}}

{{- define "llmserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "llmserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "llmserve.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: (dict "root" $ "component" "gateway"). */}}
{{- define "llmserve.componentName" -}}
{{- printf "%s-%s" (include "llmserve.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "llmserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "llmserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Labels of a Service the ServiceMonitor scrapes through. */}}
{{- define "llmserve.scrapeLabel" -}}
llmserve.io/scrape: "true"
{{- end }}

{{- define "llmserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llmserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference: (dict "root" $ "image" .Values.gateway.image). */}}
{{- define "llmserve.image" -}}
{{- $registry := .root.Values.image.registry }}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- if $registry }}
{{- printf "%s/%s:%s" (trimSuffix "/" $registry) .image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/* In-cluster DNS name of one component's Service (same namespace). */}}
{{- define "llmserve.serviceHost" -}}
{{- printf "%s.%s.svc" (include "llmserve.componentName" .) .root.Release.Namespace }}
{{- end }}

{{/* The component whose pods run preprocess: its own, or inference's when co-located. */}}
{{- define "llmserve.preprocessComponent" -}}
{{- if .Values.colocated.enabled }}inference{{ else }}preprocess{{ end }}
{{- end }}

{{/* Preprocess's metrics port: in a co-located pod inference already holds metrics.port. */}}
{{- define "llmserve.preprocessMetricsPort" -}}
{{- if .Values.colocated.enabled }}{{ add .Values.metrics.port 1 }}{{ else }}{{ .Values.metrics.port }}{{ end }}
{{- end }}

{{/* The checkpoint directory as the containers see it. */}}
{{- define "llmserve.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.dir }}
{{- end }}

{{- define "llmserve.redisUrl" -}}
{{- printf "redis://%s:%v/%d" (include "llmserve.serviceHost" (dict "root" .root "component" "redis")) .root.Values.redis.builtin.port .db }}
{{- end }}

{{/* Whether services get a routing / prompt-cache Redis URL. */}}
{{- define "llmserve.hasRoutingRedis" -}}
{{- if or (eq .Values.redis.mode "builtin") (and (eq .Values.redis.mode "external") (or .Values.redis.external.routingUrl .Values.redis.external.existingSecret)) }}true{{ end }}
{{- end }}

{{- define "llmserve.hasPromptCacheRedis" -}}
{{- if or (eq .Values.redis.mode "builtin") (and (eq .Values.redis.mode "external") (or .Values.redis.external.promptCacheUrl .Values.redis.external.existingSecret)) }}true{{ end }}
{{- end }}

{{/* The size of the inference pod's memory-backed /dev/shm, or "" for none: co-located
preprocess (the same-host transport) or tensor parallelism (NCCL's intra-node buffers). */}}
{{- define "llmserve.inferenceShmSize" -}}
{{- if .Values.colocated.enabled }}{{ .Values.colocated.shmSizeLimit }}
{{- else if gt (int .Values.inference.tensorParallel.size) 1 }}{{ .Values.inference.tensorParallel.shmSizeLimit }}
{{- end }}
{{- end }}
