{{/*
A drafter or verifier pool: dict "root" . "component" "drafter"|"verifier".

A StatefulSet, not a Deployment: the orchestrator keeps each session on one replica and
addresses replicas one by one, so each needs a stable DNS name
(<fullname>-<component>-<i>.<fullname>-<component>...), which a StatefulSet behind a
headless Service gives. Pods start in parallel (no ordering is needed).
*/}}

{{- define "presto-sd.engine.statefulset" -}}
{{- $root := .root }}
{{- $c := index $root.Values .component }}
{{- $name := printf "%s-%s" (include "presto-sd.fullname" $root) .component }}
{{- $volumes := dict "root" $root "models" true "shm" "" }}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "presto-sd.componentLabels" . | trim | nindent 4 }}
spec:
  serviceName: {{ $name }}
  replicas: {{ $c.replicas }}
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  selector:
    matchLabels:
      {{- include "presto-sd.componentSelectorLabels" . | trim | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "presto-sd.componentLabels" . | trim | nindent 8 }}
        {{- with $c.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "presto-sd.configChecksums" $root | trim | nindent 8 }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "presto-sd.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
      {{- with $c.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "presto-sd.fetchInitContainer" $root) }}
      initContainers:
        {{- . | trim | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "presto-sd.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - serve
            - {{ .component }}
            - --host
            - 0.0.0.0
            - --port
            - {{ $c.port | quote }}
            {{- with $root.Values.model.target }}
            - --target
            - {{ . | quote }}
            {{- end }}
            {{- with $root.Values.model.drafter }}
            - --drafter
            - {{ . | quote }}
            {{- end }}
            # the limits come from the engine ConfigMap (Kubernetes expands $(VAR))
            - --max-sessions
            - $(PRESTO_SD_MAX_SESSIONS)
            - --session-ttl-s
            - $(PRESTO_SD_SESSION_TTL_S)
            - --max-message-mb
            - $(PRESTO_SD_MAX_MESSAGE_MB)
            - --drain-s
            - $(PRESTO_SD_DRAIN_S)
            - --grace-s
            - $(PRESTO_SD_GRACE_S)
            {{- if $c.threads }}
            - --threads
            - {{ $c.threads | quote }}
            {{- end }}
            {{- range include "presto-sd.securityArgs" (dict "root" $root "roles" (list "server")) | fromJsonArray }}
            - {{ . | quote }}
            {{- end }}
            {{- range $c.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $c.port }}
              protocol: TCP
          envFrom:
            - configMapRef:
                name: {{ include "presto-sd.engineConfigMapName" $root }}
          env:
            {{- include "presto-sd.env" $root | trim | nindent 12 }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $serverName := printf "{hostname}.%s.%s.svc.%s" $name $root.Release.Namespace $root.Values.clusterDomain }}
          {{- include "presto-sd.probes" (dict "root" $root "port" $c.port "serverName" $serverName) | trim | nindent 10 }}
          resources:
            {{- include "presto-sd.resourcesWithGpu" (dict "resources" $c.resources "gpu" $c.gpu) | trim | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "presto-sd.volumeMounts" $volumes | trim | nindent 12 }}
      volumes:
        {{- include "presto-sd.volumes" $volumes | trim | nindent 8 }}
{{- end }}

{{/* The headless Service: DNS names per replica, no load balancing. */}}
{{- define "presto-sd.engine.service" -}}
{{- $c := index .root.Values .component }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "presto-sd.fullname" .root }}-{{ .component }}
  labels:
    {{- include "presto-sd.componentLabels" . | trim | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "presto-sd.componentSelectorLabels" . | trim | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $c.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end }}

{{/* A PodDisruptionBudget of one component (shared with the orchestrator Deployment). */}}
{{- define "presto-sd.pdb" -}}
{{- $c := index .root.Values .component }}
{{- if $c.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "presto-sd.fullname" .root }}-{{ .component }}
  labels:
    {{- include "presto-sd.componentLabels" . | trim | nindent 4 }}
spec:
  maxUnavailable: {{ $c.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "presto-sd.componentSelectorLabels" . | trim | nindent 6 }}
{{- end }}
{{- end }}
