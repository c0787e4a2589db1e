{{/*
Checks across fields that values.schema.json cannot express; each fails the install with
what to change. Included once, from configmap-engine.yaml.
*/}}
{{- define "presto-sd.validate" -}}
{{- $v := .Values }}
{{- if eq $v.image.tag "latest" }}
{{- fail "image.tag: pin a version, not \"latest\" (pods of one release must run the same build, and a rollback needs the old one)" }}
{{- end }}
{{- if and (eq $v.modelStorage.type "emptyDir") (not $v.modelStorage.fetch.enabled) }}
{{- fail "modelStorage: an emptyDir volume starts empty; turn modelStorage.fetch.enabled on, or use type pvc / existingClaim with the weights in it" }}
{{- end }}
{{- $stop := add (ceil $v.limits.drainSeconds) (ceil $v.limits.graceSeconds) }}
{{- range $name := list "drafter" "verifier" "orchestrator" }}
{{- $c := index $v $name }}
{{- if le (int $c.terminationGracePeriodSeconds) (int $stop) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed limits.drainSeconds + limits.graceSeconds (%d), or a stopping server is killed mid-drain" $name (int $c.terminationGracePeriodSeconds) (int $stop)) }}
{{- end }}
{{- end }}
{{- $w := $v.orchestrator.kuberay.workers }}
{{- if or (gt (int $w.minReplicas) (int $w.replicas)) (gt (int $w.replicas) (int $w.maxReplicas)) }}
{{- fail (printf "orchestrator.kuberay.workers: need minReplicas <= replicas <= maxReplicas, got %d, %d, %d" (int $w.minReplicas) (int $w.replicas) (int $w.maxReplicas)) }}
{{- end }}
{{- end }}
