{{/* What every llmserve pod has: security, scratch and model volumes, the model fetch, probes, drain. */}}

{{- define "llmserve.podSpecCommon" -}}
serviceAccountName: {{ include "llmserve.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: a changed shared ConfigMap rolls every pod. */}}
{{- define "llmserve.podAnnotations" -}}
checksum/shared-config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- with .annotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "llmserve.volumes" -}}
- name: model
  {{- $volume := .Values.model.volume }}
  {{- if eq $volume.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $volume.pvc.claimName }}
  {{- else if eq $volume.type "hostPath" }}
  hostPath:
    {{- toYaml $volume.hostPath | nindent 4 }}
  {{- else }}
  emptyDir:
    {{- toYaml $volume.emptyDir | nindent 4 }}
  {{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "llmserve.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The environment of every container: scratch HOME (the root filesystem is read-only) and the shared ConfigMap. */}}
{{- define "llmserve.env" -}}
env:
  - name: HOME
    value: /tmp
  - name: TMPDIR
    value: /tmp
  {{- if .podName }}
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- end }}
  {{- $external := .root.Values.redis.external }}
  {{- if and (eq .root.Values.redis.mode "external") $external.existingSecret }}
  - name: LLMSERVE_ROUTING_REDIS_URL
    valueFrom:
      secretKeyRef:
        name: {{ $external.existingSecret }}
        key: {{ $external.routingUrlKey }}
  - name: LLMSERVE_PROMPT_CACHE_REDIS_URL
    valueFrom:
      secretKeyRef:
        name: {{ $external.existingSecret }}
        key: {{ $external.promptCacheUrlKey }}
  {{- end }}
envFrom:
  - configMapRef:
      name: {{ include "llmserve.componentName" (dict "root" .root "component" "shared") }}
{{- end }}

{{- define "llmserve.initContainers" -}}
{{- if .Values.model.fetch.enabled }}
initContainers:
  - name: fetch-model
    image: {{ include "llmserve.image" (dict "root" . "image" .Values.preprocess.image) }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: [llmserve, fetch-model]
    args:
      - --model
      - {{ .Values.model.fetch.spec | quote }}
      - --cache-dir
      - {{ .Values.model.mountPath | quote }}
    {{- include "llmserve.env" (dict "root" .) | nindent 4 }}
    resources:
      {{- toYaml .Values.model.fetch.resources | nindent 6 }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}

{{/*
The flags every service takes (llmserve/server_flags.py):
(dict "root" $ "port" 50051 "metricsPort" 9400 "drain" .Values.gateway.drain).
*/}}
{{- define "llmserve.serverArgs" -}}
- --host
- 0.0.0.0
- --port
- {{ .port | quote }}
- --grace-period-s
- {{ .drain.drainSeconds | quote }}
- --metrics-port
- {{ .metricsPort | quote }}
- --log-format
- {{ .root.Values.logging.format }}
- --log-level
- {{ .root.Values.logging.level }}
{{- if .root.Values.logging.prompts }}
- --log-prompts
{{- end }}
- --model
- $(LLMSERVE_MODEL_DIR)
{{- if .root.Values.model.name }}
- --model-name
- $(LLMSERVE_MODEL_NAME)
{{- end }}
{{- end }}

{{/* The flags preprocess and inference must agree on, from the shared ConfigMap; the same flag names on both (include with the root context). */}}
{{- define "llmserve.sharedArgs" -}}
- --block-size
- $(LLMSERVE_BLOCK_SIZE_TOKENS)
- --length-buckets
- $(LLMSERVE_BUCKETS)
{{- if .Values.shared.maxContextTokens }}
- --max-context-tokens
- $(LLMSERVE_MAX_CONTEXT_TOKENS)
{{- end }}
{{- end }}

{{/*
Probes on grpc.health.v1 with the service's full name, as the kubelet asks them:
(dict "port" 50051 "service" "llmserve.v1.GatewayService" "startupTimeoutSeconds" 600).
*/}}
{{- define "llmserve.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div (add .startupTimeoutSeconds 9) 10 }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service }}
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{- define "llmserve.preStop" -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .preStopSleepSeconds }}
{{- end }}

{{- define "llmserve.ports" -}}
ports:
  - name: {{ .grpcName }}
    containerPort: {{ .port }}
    protocol: TCP
  - name: {{ .metricsName }}
    containerPort: {{ .metricsPort }}
    protocol: TCP
{{- if .httpPort }}
  - name: http
    containerPort: {{ .httpPort }}
    protocol: TCP
{{- end }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of one component's values. */}}
{{- define "llmserve.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Every pod of the component on one node (KV pull: the replicas share that node's memory). */}}
{{- define "llmserve.oneNodeAffinity" -}}
podAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - labelSelector:
        matchLabels:
          {{- include "llmserve.selectorLabels" . | nindent 10 }}
      topologyKey: kubernetes.io/hostname
{{- end }}
