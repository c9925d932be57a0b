{{/* The namespace every object goes in: namespace.name, else the release's. */}}
{{- define "vigil.namespace" -}}
{{- .Values.namespace.name | default .Release.Namespace -}}
{{- end }}

{{/* Labels every object carries (the kustomize base's `labels`), then commonLabels. */}}
{{- define "vigil.labels" -}}
app.kubernetes.io/part-of: vigil
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The NATS users (vigil_common/credentials.py's roles; all worker nodes share `worker`'s password). */}}
{{- define "vigil.natsRoles" -}}
admin scheduler guardian telemetry worker
{{- end }}

{{/* The Secret holding the NATS passwords, the API token and (unless postgres.existingSecret) the URL. */}}
{{- define "vigil.secretName" -}}
{{- .Values.secrets.existingSecret | default "vigil-secrets" -}}
{{- end }}

{{- define "vigil.checkpointsClaim" -}}
{{- .Values.checkpoints.existingClaim | default "vigil-checkpoints" -}}
{{- end }}

{{/* image: and imagePullPolicy: of a container, from a {repository, tag, pullPolicy}. */}}
{{- define "vigil.image" -}}
image: {{ printf "%s:%s" .repository (toString .tag) | quote }}
{{- with .pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{- define "vigil.workerImage" -}}
{{- $w := .Values.worker.image -}}
{{- include "vigil.image" (dict "repository" $w.repository "tag" ($w.tag | default .Values.image.tag) "pullPolicy" ($w.pullPolicy | default .Values.image.pullPolicy)) }}
{{- end }}

{{- define "vigil.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "vigil.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: ["ALL"]
{{- end }}

{{/* VIGIL_STREAM_REPLICAS: the NATS servers', so streams survive the loss of a server. */}}
{{- define "vigil.streamReplicas" -}}
- name: VIGIL_STREAM_REPLICAS
  value: {{ .Values.nats.replicas | int | toString | quote }}
{{- end }}

{{- define "vigil.databaseUrl" -}}
- name: VIGIL_DATABASE_URL
  valueFrom:
    secretKeyRef:
      {{- if .Values.postgres.existingSecret }}
      name: {{ .Values.postgres.existingSecret }}
      key: {{ .Values.postgres.existingSecretKey }}
      {{- else }}
      name: {{ include "vigil.secretName" . }}
      key: database-url
      {{- end }}
{{- end }}

{{/* The environment the scheduler, telemetry and guardian start with: their own NATS user, the
streams' replicas, the database. dict: root (the chart's context), role (the NATS user). */}}
{{- define "vigil.serviceEnv" -}}
{{- $root := .root -}}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "vigil.secretName" $root }}
      key: nats-{{ .role }}-password
- name: VIGIL_NATS_URL
  value: nats://{{ .role }}:$(NATS_PASSWORD)@nats:4222
{{ include "vigil.streamReplicas" $root }}
{{ include "vigil.databaseUrl" $root }}
- name: VIGIL_DATA_DIR
  value: /var/lib/vigil
- name: VIGIL_LOG_LEVEL
  value: {{ $root.Values.logLevel | quote }}
{{- end }}

{{/* The two replicas (or more) of a Deployment on different nodes, where there are several. */}}
{{- define "vigil.spreadAffinity" -}}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              app.kubernetes.io/name: {{ . }}
{{- end }}

{{- define "vigil.checkpointsVolume" -}}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "vigil.checkpointsClaim" . }}
{{- end }}

{{/* A PodDisruptionBudget that keeps one replica through a drain, where there are several.
dict: root, name. */}}
{{- define "vigil.disruptionBudget" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ include "vigil.namespace" .root }}
  labels:
    app.kubernetes.io/name: {{ .name }}
    {{- include "vigil.labels" .root | nindent 4 }}
spec:
  minAvailable: 1
  selector:
    matchLabels:
      app.kubernetes.io/name: {{ .name }}
{{- end }}
