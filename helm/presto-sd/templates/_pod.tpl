{{/*
Pieces every presto-sd pod shares: writable scratch dirs under a read-only root, the model
volume and its fetch init container, the TLS and auth-token secrets and the flags that use
them, and the gRPC health probes.
*/}}

{{- define "presto-sd.tlsDir" -}}/etc/presto-sd/tls{{- end }}
{{- define "presto-sd.authTokenPath" -}}/etc/presto-sd/auth/token{{- end }}
{{- define "presto-sd.probeScript" -}}/etc/presto-sd/probe/health_probe.py{{- end }}

{{/* Environment of every presto-sd container that loads models: caches on writable volumes. */}}
{{- define "presto-sd.env" -}}
- name: PRESTO_SD_CACHE
  value: {{ .Values.modelStorage.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelStorage.mountPath | quote }}
{{ include "presto-sd.scratchEnv" . }}
{{- end }}

{{/* Scratch and cache locations under the read-only root: /tmp and /cache are emptyDirs. */}}
{{- define "presto-sd.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /cache/inductor
- name: MPLCONFIGDIR
  value: /cache/matplotlib
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: PIP_NO_CACHE_DIR
  value: "1"
{{- end }}

{{/* Volumes: dict "root" . "models" bool "shm" size-or-empty */}}
{{- define "presto-sd.volumes" -}}
{{- $v := .root.Values }}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- if .shm }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- end }}
{{- if .models }}
- name: models
  {{- if eq $v.modelStorage.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "presto-sd.fullname" .root }}-models
  {{- else if eq $v.modelStorage.type "existingClaim" }}
  persistentVolumeClaim:
    claimName: {{ $v.modelStorage.existingClaim }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ $v.modelStorage.emptyDirSizeLimit }}
  {{- end }}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $v.tls.secretName }}
    defaultMode: 0440
- name: probe
  configMap:
    name: {{ include "presto-sd.fullname" .root }}-probe
{{- end }}
{{- if $v.auth.enabled }}
- name: auth
  secret:
    secretName: {{ include "presto-sd.authSecretName" .root }}
    defaultMode: 0440
    items:
      - key: {{ $v.auth.secretKey }}
        path: token
{{- end }}
{{- end }}

{{/* Mounts matching presto-sd.volumes: same dict */}}
{{- define "presto-sd.volumeMounts" -}}
{{- $v := .root.Values }}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .shm }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .models }}
- name: models
  mountPath: {{ $v.modelStorage.mountPath }}
  readOnly: {{ $v.modelStorage.readOnly }}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: {{ include "presto-sd.tlsDir" . }}
  readOnly: true
- name: probe
  mountPath: /etc/presto-sd/probe
  readOnly: true
{{- end }}
{{- if $v.auth.enabled }}
- name: auth
  mountPath: /etc/presto-sd/auth
  readOnly: true
{{- end }}
{{- end }}

{{/* The init container that fills the model volume (when modelStorage.fetch.enabled). */}}
{{- define "presto-sd.fetchInitContainer" -}}
{{- $v := .Values }}
{{- if $v.modelStorage.fetch.enabled }}
- name: fetch-models
  image: {{ include "presto-sd.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  # flock: pods sharing one claim fetch one at a time; the fetch skips what is present
  command:
    - flock
    - {{ printf "%s/.fetch.lock" $v.modelStorage.mountPath }}
    {{- toYaml $v.modelStorage.fetch.command | nindent 4 }}
  env:
    {{- include "presto-sd.env" . | trim | nindent 4 }}
  resources:
    {{- toYaml $v.modelStorage.fetch.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
    - name: models
      mountPath: {{ $v.modelStorage.mountPath }}
{{- end }}
{{- end }}

{{/* TLS flags of a presto-sd server, as a JSON list (as are the next three). */}}
{{- define "presto-sd.tlsServerArgs" -}}
{{- $dir := include "presto-sd.tlsDir" . }}
{{- $args := list }}
{{- if .Values.tls.enabled }}
{{- $args = list "--tls-cert" (printf "%s/tls.crt" $dir) "--tls-key" (printf "%s/tls.key" $dir) }}
{{- if .Values.tls.mutual }}
{{- $args = concat $args (list "--tls-client-ca" (printf "%s/ca.crt" $dir)) }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/* TLS flags of a presto-sd gRPC client (the orchestrator towards the engines, the test Pod). */}}
{{- define "presto-sd.tlsClientArgs" -}}
{{- $dir := include "presto-sd.tlsDir" . }}
{{- $args := list }}
{{- if .Values.tls.enabled }}
{{- $args = list "--tls-ca" (printf "%s/ca.crt" $dir) }}
{{- if .Values.tls.mutual }}
{{- $args = concat $args (list "--tls-client-cert" (printf "%s/tls.crt" $dir) "--tls-client-key" (printf "%s/tls.key" $dir)) }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/* The token flag: servers require the token in the file, clients send it. */}}
{{- define "presto-sd.authArgs" -}}
{{- if .Values.auth.enabled }}
{{- toJson (list "--auth-token-file" (include "presto-sd.authTokenPath" .)) }}
{{- else }}
{{- toJson list }}
{{- end }}
{{- end }}

{{/*
Security flags of a process, by the roles it plays: dict "root" . "roles" (list ...).
"server": it serves TLS and requires the token; "client": it calls a presto-sd server
(generate, the test Pod); "engineClient": the orchestrator calling the drafter and
verifier, whose flags carry an --engine- prefix (--engine-tls-ca, ...).
*/}}
{{- define "presto-sd.securityArgs" -}}
{{- $root := .root }}
{{- $args := list }}
{{- if has "server" .roles }}
{{- $args = concat $args (include "presto-sd.tlsServerArgs" $root | fromJsonArray) (include "presto-sd.authArgs" $root | fromJsonArray) }}
{{- end }}
{{- if has "client" .roles }}
{{- $args = concat $args (include "presto-sd.tlsClientArgs" $root | fromJsonArray) (include "presto-sd.authArgs" $root | fromJsonArray) }}
{{- end }}
{{- if has "engineClient" .roles }}
{{- range concat (include "presto-sd.tlsClientArgs" $root | fromJsonArray) (include "presto-sd.authArgs" $root | fromJsonArray) }}
{{- $args = append $args (regexReplaceAll "^--" . "--engine-") }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/*
One health check on grpc.health.v1.Health: dict "root" . "port" P "serverName" N.
Native gRPC probes speak plaintext only, so with TLS it is files/health_probe.py over TLS.
*/}}
{{- define "presto-sd.healthCheck" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command:
    - python
    - {{ include "presto-sd.probeScript" . }}
    - --port
    - {{ .port | quote }}
    - --tls-dir
    - {{ include "presto-sd.tlsDir" . }}
    - --server-name
    - {{ .serverName | quote }}
    {{- if .root.Values.tls.mutual }}
    - --client-cert
    {{- end }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end }}

{{/* startup, readiness and liveness probes: same dict as presto-sd.healthCheck */}}
{{- define "presto-sd.probes" -}}
{{- $p := .root.Values.probes }}
startupProbe:
  {{- include "presto-sd.healthCheck" . | trim | nindent 2 }}
  {{- toYaml $p.startup | nindent 2 }}
readinessProbe:
  {{- include "presto-sd.healthCheck" . | trim | nindent 2 }}
  {{- toYaml $p.readiness | nindent 2 }}
livenessProbe:
  {{- include "presto-sd.healthCheck" . | trim | nindent 2 }}
  {{- toYaml $p.liveness | nindent 2 }}
{{- end }}

{{/* GPU of a component added to its resources: dict "resources" R "gpu" G */}}
{{- define "presto-sd.resourcesWithGpu" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if gt (int .gpu.count) 0 }}
{{- $limits := default dict $res.limits }}
{{- $requests := default dict $res.requests }}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) }}
{{- $_ := set $requests .gpu.resourceName (int .gpu.count) }}
{{- $_ := set $res "limits" $limits }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}
