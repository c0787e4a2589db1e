{{/*
The orchestrator container, shared by the KubeRay head (orchestrator-raycluster.yaml) and
the plain Deployment (orchestrator-deployment.yaml). It starts Ray, then execs
`presto-sd serve orchestrator`, so the server is the container's main process and gets
SIGTERM itself.
*/}}

{{- define "presto-sd.shellQuote" -}}
'{{ replace "'" "'\\''" (toString .) }}'
{{- end }}

{{/* Every pod of the Ray cluster (head and workers) carries it: the metrics Service selects it. */}}
{{- define "presto-sd.rayNodeLabel" -}}
presto-sd/ray-node: "true"
{{- end }}

{{/* The `serve orchestrator` command line as one shell string. */}}
{{- define "presto-sd.orchestrator.serveCommand" -}}
{{- $v := .Values }}
{{- $words := list "exec presto-sd serve orchestrator --host 0.0.0.0" (printf "--port %d" (int $v.orchestrator.port)) }}
{{- $drafters := include "presto-sd.replicaAddresses" (dict "root" . "component" "drafter" "replicas" $v.drafter.replicas "port" $v.drafter.port) }}
{{- $verifiers := include "presto-sd.replicaAddresses" (dict "root" . "component" "verifier" "replicas" $v.verifier.replicas "port" $v.verifier.port) }}
{{- $words = append $words (printf "--drafter-addr %s" $drafters) }}
{{- $words = append $words (printf "--verifier-addr %s" $verifiers) }}
{{- $words = append $words "--ray-address auto" }}
{{- /* engine settings from the ConfigMap's variables; an absent optional one adds no flag */}}
{{- $words = append $words "--method \"$PRESTO_SD_METHOD\" --budget \"$PRESTO_SD_BUDGET\"" }}
{{- $words = append $words "${PRESTO_SD_DEPTH:+--depth \"$PRESTO_SD_DEPTH\"}" }}
{{- $words = append $words "${PRESTO_SD_LAMBDA:+--lambda \"$PRESTO_SD_LAMBDA\"}" }}
{{- $words = append $words "--max-new-tokens \"$PRESTO_SD_MAX_NEW_TOKENS\"" }}
{{- $words = append $words "--drain-s \"$PRESTO_SD_DRAIN_S\" --grace-s \"$PRESTO_SD_GRACE_S\"" }}
{{- /* the tokenizer (and in-process engines, unused here) come from the same model pair */}}
{{- with $v.model.target }}
{{- $words = append $words (printf "--target %s" (include "presto-sd.shellQuote" .)) }}
{{- end }}
{{- with $v.model.drafter }}
{{- $words = append $words (printf "--drafter %s" (include "presto-sd.shellQuote" .)) }}
{{- end }}
{{- /* a server towards its callers, a client of the engines */}}
{{- $security := include "presto-sd.securityArgs" (dict "root" . "roles" (list "server" "engineClient")) | fromJsonArray }}
{{- range concat $security $v.orchestrator.extraArgs }}
{{- $words = append $words (include "presto-sd.shellQuote" .) }}
{{- end }}
{{- join " " $words }}
{{- end }}

{{/* The container: dict "root" . "kuberay" bool */}}
{{- define "presto-sd.orchestrator.container" -}}
{{- $root := .root }}
{{- $o := $root.Values.orchestrator }}
{{- $volumes := dict "root" $root "models" true "shm" $o.shmSize }}
# KubeRay's examples name the head container ray-head; the Deployment's says what it runs
- name: {{ ternary "ray-head" "orchestrator" .kuberay }}
  image: {{ include "presto-sd.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["/bin/bash", "-c", "--"]
  args:
    - |-
      set -euo pipefail
      ulimit -n 65536 || true
      {{- if .kuberay }}
      # KubeRay's own `ray start` for this head (KUBERAY_GEN_RAY_START_CMD), without its
      # --block, so the orchestrator can run after it
      ${KUBERAY_GEN_RAY_START_CMD/--block/}
      {{- else }}
      # a one-node Ray in this pod
      ray start --head --dashboard-host=0.0.0.0 --metrics-export-port={{ $o.metricsPort }} --disable-usage-stats
      {{- end }}
      {{ include "presto-sd.orchestrator.serveCommand" $root }}
  ports:
    - name: grpc
      containerPort: {{ $o.port }}
      protocol: TCP
    - name: gcs
      containerPort: 6379
      protocol: TCP
    - name: dashboard
      containerPort: {{ $o.dashboardPort }}
      protocol: TCP
    - name: client
      containerPort: 10001
      protocol: TCP
    - name: metrics
      containerPort: {{ $o.metricsPort }}
      protocol: TCP
  envFrom:
    - configMapRef:
        name: {{ include "presto-sd.engineConfigMapName" $root }}
  env:
    {{- include "presto-sd.env" $root | trim | nindent 4 }}
    {{- with $o.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $serverName := include "presto-sd.orchestratorHost" $root }}
  {{- include "presto-sd.probes" (dict "root" $root "port" $o.port "serverName" $serverName) | trim | nindent 2 }}
  resources:
    {{- toYaml $o.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "presto-sd.volumeMounts" $volumes | trim | nindent 4 }}
{{- end }}

{{/* Pod-spec fields the head, the workers and the Deployment share (after `containers`). */}}
{{- define "presto-sd.orchestrator.podFields" -}}
{{- $v := .Values }}
serviceAccountName: {{ include "presto-sd.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $v.orchestrator.terminationGracePeriodSeconds }}
{{- with $v.orchestrator.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.orchestrator.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.orchestrator.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
